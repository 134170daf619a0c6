"""The ``ray`` backend: a local Ray instance, and a cluster started by ``ray start --head``.

Without Ray these tests skip loudly; in CI (``CI`` set) Ray must be there (``.[dev]`` brings it).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from bench import orphans
from fedlink.common.errors import InvalidArgument
from fedlink.simulation import RayConfig, run_simulation

from .conftest import Digits, softmax_job

_F = TypeVar("_F", bound=Callable[..., None])

#: Ray's own warnings, filtered in the tests that run Ray only.
RAY_WARNINGS: tuple[pytest.MarkDecorator, ...] = (
    pytest.mark.filterwarnings(r"ignore::DeprecationWarning:ray(\..*)?"),
    pytest.mark.filterwarnings(r"ignore::FutureWarning:ray(\..*)?"),
)


@pytest.fixture(autouse=True)
def patient_ray_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray waits 30 s for its GCS to bind; a busy two-core machine once needed more (CI: "Timed out
    waiting for file .../gcs_server_port_..."). Two minutes, for ``ray.init`` here and ``ray start`` in
    subprocesses alike."""
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "120")


#: Not beside the loaded pass's busy processes: Ray's own start-up (GCS, raylet) times out on two
#: loaded cores ("The current node timed out during startup"); the main pass runs these tests.
NOT_UNDER_LOAD = pytest.mark.not_under_load


def ray_test(test: _F) -> _F:
    """Marks a test that runs Ray: slow (with the slow tests' longer timeout), Ray's warnings filtered,
    and left out of the loaded pass."""
    for mark in (pytest.mark.slow, NOT_UNDER_LOAD, *RAY_WARNINGS):
        test = mark(test)
    return test


def need_ray() -> None:
    """Skips (loudly) without Ray; fails in CI, where ``pip install -e '.[dev]'`` installs it."""
    try:
        import ray  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("Ray is not installed in CI: .[dev] must bring fedlink[ray]")
        pytest.skip(
            "!!! RAY IS NOT INSTALLED: the ray backend is NOT tested here (pip install 'fedlink[ray]')"
        )


def test_ray_backend_config_is_validated_before_ray_starts() -> None:
    job = softmax_job(rounds=1)
    with pytest.raises(
        InvalidArgument, match=r"unknown backend_config key.*ray backend: gpus; valid: address"
    ):
        run_simulation(job, 2, backend="ray", backend_config={"gpus": 1})
    with pytest.raises(InvalidArgument, match=r"client_resources key.*: memory; valid: num_cpus, num_gpus"):
        run_simulation(job, 2, backend="ray", backend_config={"client_resources": {"memory": 1}})
    with pytest.raises(InvalidArgument, match="num_cpus sizes a local Ray instance: not with address"):
        run_simulation(job, 2, backend="ray", backend_config={"address": "auto", "num_cpus": 2})
    with pytest.raises(InvalidArgument, match="actor_count must be an integer >= 1"):
        RayConfig.parse({"actor_count": 0})
    config = RayConfig.parse({"num_cpus": 2, "client_resources": {"num_cpus": 0.5}, "actor_count": 3})
    assert (config.num_cpus, config.client_num_cpus, config.actor_count) == (2, 0.5, 3)


@ray_test
def test_ray_backend_agrees_with_local(digits: Digits) -> None:
    need_ray()
    import ray

    job = softmax_job(rounds=2)
    local = run_simulation(job, 12, data=digits.source(), seed=3)
    on_ray = run_simulation(
        job, 12, data=digits.source(), seed=3, backend="ray", backend_config={"num_cpus": 2}
    )
    assert not ray.is_initialized(), "the backend started Ray, so it must shut it down"
    assert not on_ray.failures
    assert on_ray.participation == local.participation
    for name, array in local.arrays.items():
        np.testing.assert_allclose(on_ray.arrays[name], array, rtol=1e-6, err_msg=name)
    assert digits.accuracy(on_ray.arrays) > 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@ray_test
def test_ray_backend_joins_a_running_cluster(digits: Digits) -> None:
    need_ray()
    import ray

    ray_cli = str(Path(sys.executable).parent / "ray")
    port = _free_port()
    # A short temp dir: Ray's socket paths must fit in 107 bytes.
    temp = tempfile.mkdtemp(prefix="fr", dir="/tmp")
    # --block keeps `ray start` in the foreground, so the test stops the cluster it started (and only
    # that one) by terminating this process, instead of a machine-wide `ray stop`. Through the reaper,
    # which ends Ray's processes if the test dies first.
    head = subprocess.Popen(
        orphans.reaped([
            ray_cli, "start", "--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
            "--node-ip-address=127.0.0.1", f"--temp-dir={temp}", "--block",
        ], grace_s=20),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert head.poll() is None, "ray start --head exited"
            assert time.monotonic() < deadline, "ray start --head did not listen within 180 s"
            time.sleep(0.2)
        job = softmax_job(rounds=1)
        local = run_simulation(job, 6, data=digits.source(), seed=5)
        joined = run_simulation(
            job,
            6,
            data=digits.source(),
            seed=5,
            backend="ray",
            backend_config={"address": f"127.0.0.1:{port}", "actor_count": 2},
        )
        assert not ray.is_initialized()
        assert not joined.failures
        for name, array in local.arrays.items():
            np.testing.assert_allclose(joined.arrays[name], array, rtol=1e-6, err_msg=name)
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
