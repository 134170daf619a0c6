"""The simulation against the wire: its gRPC transport option, and real ``fedlink`` processes.

The same job file, seed and data partitions run three ways — simulated in-process, simulated over
loopback gRPC, and as ``fedlink serve`` with five ``fedlink runner`` processes — and must end with
the same model, bit for bit. The last way against ``fedlink simulate`` itself: the job file's
``[simulation]`` section gives the virtual devices the runners' data file, split as the runners'
``--partition`` flags split it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.orphans import tied
from fedlink.runner.data import NpzDataSource, PartitionedDataSource
from fedlink.simulation import run_simulation

from .conftest import AddPartition, Digits, job_with

FEDLINK = str(Path(sys.executable).parent / "fedlink")
DEVICES = 5
ADMIN = "simulation-equality-admin-token"
#: How long to wait for a process (or the job) to get somewhere: seconds on a quiet machine; far beyond
#: that, so that a loaded machine is no failure, and a hang still is one.
PROCESS_WAIT_S = 180.0

JOB = """
name = "equality"
model = "model.npz"

[fedavg]
num_rounds = 3
devices_per_round = 5
min_results = 5
min_devices = 5
seed = 11
round_timeout = "600s"  # rounds close on their results; this only bounds a stuck one

[[job_data.components]]
type = "SoftmaxRegressionTrainer"
name = "trainer"
args = { epochs = 1, learning_rate = 0.3, batch_size = 16, seed = 5 }

[simulation]                # what the runners below are given, as flags
data = "digits.npz"
partition = "dirichlet"
partition_alpha = 0.5
partition_seed = 0
"""


@pytest.fixture
def job_file(tmp_path: Path, digits: Digits) -> Path:
    """The job file, its initial model, and the whole training split as digits.npz."""
    np.savez(tmp_path / "digits.npz", x_train=digits.x_train, y_train=digits.y_train)
    np.savez(tmp_path / "model.npz", weight=np.zeros((64, 10), np.float32), bias=np.zeros(10, np.float32))
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    return path


def partitions(data: Path) -> PartitionedDataSource:
    """What ``fedlink runner --partition dirichlet --partition-alpha 0.5 --partition-seed 0`` uses."""
    return PartitionedDataSource(NpzDataSource(data), method="dirichlet", alpha=0.5, seed=0)


def test_grpc_transport_gives_the_same_model_as_in_process(job_file: Path) -> None:
    data = partitions(job_file.parent / "digits.npz")
    local = run_simulation(job_file, DEVICES, data=data)
    wire = run_simulation(job_file, DEVICES, data=data, transport="grpc")
    assert not wire.failures and wire.participation == local.participation
    assert [r.num_results for r in wire.rounds] == [DEVICES] * 3
    for name, array in local.arrays.items():
        # Same device ids, so the same sampling and aggregation order: the same bits.
        np.testing.assert_array_equal(wire.arrays[name], array, err_msg=name)
    assert not np.allclose(local.arrays["weight"], 0.0), "the model did not learn anything"


def test_grpc_transport_samples_like_in_process() -> None:
    # 2 of 6 devices per round: the same seeded sampling picks the same devices over the wire.
    job = job_with(num_rounds=3, devices_per_round=2, min_results=2, seed=4)
    local = run_simulation(job, 6, runner=AddPartition())
    wire = run_simulation(job, 6, runner=AddPartition(), transport="grpc")
    assert wire.participation == local.participation
    np.testing.assert_array_equal(wire.arrays["w"], local.arrays["w"])


def test_unknown_transport_and_heterogeneity_over_grpc_are_errors() -> None:
    from fedlink.common.errors import InvalidArgument
    from fedlink.simulation import Heterogeneity

    with pytest.raises(InvalidArgument, match="unknown transport 'tcp'; available: inprocess, grpc"):
        run_simulation(job_with(), 2, runner=AddPartition(), transport="tcp")
    with pytest.raises(InvalidArgument, match="heterogeneity needs transport='inprocess'"):
        run_simulation(
            job_with(), 2, runner=AddPartition(), transport="grpc", heterogeneity=Heterogeneity(dropout=0.5)
        )


def _serve(data_dir: Path, log: Path) -> tuple[subprocess.Popen[str], str]:
    command = [
        FEDLINK, "serve", "--insecure", "--open-enrolment", "--listen-address", "127.0.0.1:0",
        "--data-dir", str(data_dir), "--admin-token", ADMIN, "--shutdown-grace", "1s",
        "--log-level", "WARNING",
    ]  # fmt: skip
    with log.open("wb") as stderr:
        process = subprocess.Popen(tied(command), stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert process.stdout is not None
    found: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if "listening on" in line and not found:
                found.append(line.split("listening on", 1)[1].split()[0])
        process.stdout.close()  # at EOF: the process has exited

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + PROCESS_WAIT_S
    while not found:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"fedlink serve did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return process, found[0]


def _cli(*args: str, server: str) -> str:
    command = [FEDLINK, *args, "--server", server, "--insecure", "--admin-token", ADMIN]
    done = subprocess.run(
        tied(command),
        capture_output=True,
        text=True,
        timeout=PROCESS_WAIT_S,
        check=False,
    )
    assert done.returncode == 0, f"{' '.join(args)} failed: {done.stdout}{done.stderr}"
    return done.stdout


@pytest.mark.slow
def test_simulation_equals_real_runner_processes(job_file: Path, tmp_path: Path) -> None:
    work = job_file.parent
    data = work / "digits.npz"
    sim_model = tmp_path / "simulated.npz"
    done = subprocess.run(
        tied([FEDLINK, "simulate", str(job_file), "--devices", str(DEVICES), "--save-model", str(sim_model)]),
        capture_output=True,
        text=True,
        timeout=PROCESS_WAIT_S,
        cwd=tmp_path.parent,  # relative paths are the job file's, not the working directory's
        check=False,
    )
    assert done.returncode == 0, f"fedlink simulate failed: {done.stdout}{done.stderr}"
    with np.load(sim_model) as npz:
        simulated = {name: npz[name] for name in npz.files}

    serve, address = _serve(tmp_path / "coordinator", tmp_path / "serve.log")
    runners: list[subprocess.Popen[bytes]] = []
    try:
        job_id = json.loads(_cli("job", "submit", str(job_file), "--format", "json", server=address))[
            "job_id"
        ]
        for i in range(DEVICES):
            command = [
                FEDLINK, "runner", "--server", address, "--insecure", "--state-dir", str(tmp_path / f"r{i}"),
                "--data", str(data), "--partition-id", str(i), "--num-partitions", str(DEVICES),
                "--partition", "dirichlet", "--partition-alpha", "0.5", "--partition-seed", "0",
                "--job-timeout", "60s", "--task-wait", "5s", "--log-level", "WARNING",
            ]  # fmt: skip
            with (tmp_path / f"runner-{i}.log").open("wb") as log:
                runners.append(subprocess.Popen(tied(command), stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 2 * PROCESS_WAIT_S
        while True:
            state = json.loads(_cli("job", "show", job_id, "--format", "json", server=address))["state"]
            if state in ("FINISHED", "FAILED", "ABORTED") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert state == "FINISHED", (
            f"the real job ended {state}; runner 0 log: {(tmp_path / 'runner-0.log').read_text()}"
        )
        model_file = tmp_path / "final.npz"
        _cli("job", "download", job_id, "--output", str(model_file), server=address)
        with np.load(model_file) as npz:
            real = {name: npz[name] for name in npz.files}
    finally:
        processes: list[subprocess.Popen[Any]] = [*runners, serve]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=PROCESS_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert set(real) == set(simulated)
    for name, array in simulated.items():
        # The same partitions and seeds, aggregated in float64: the same bits.
        np.testing.assert_array_equal(real[name], array, err_msg=name)
    assert not np.allclose(simulated["weight"], 0.0), "the model did not learn anything"


class RecordsThread(AddPartition):
    """AddPartition that notes which thread ran each task."""

    def __init__(self) -> None:
        self.threads: set[str] = set()

    def execute(self, dxo: Any, ctx: Any, abort_signal: Any) -> Any:
        self.threads.add(threading.current_thread().name)
        return super().execute(dxo, ctx, abort_signal)


def test_task_work_runs_on_the_backend_pool_through_the_runner_worker_seam() -> None:
    executor = RecordsThread()
    result = run_simulation(job_with(), 4, runner=executor, backend_config={"num_cpus": 2})
    assert not result.failures
    # The local backend's pool, given to every Runner as worker=, not the loop's default executor.
    assert executor.threads and all(name.startswith("fedlink-sim") for name in executor.threads)
    assert len(executor.threads) <= 2
