"""A workflow of one's own, end to end: the cyclic example under ``fedlink serve`` with real runners.

The coordinator is told to allow the example's module and finds it on its PYTHONPATH; the job is the
example's own job file, submitted with ``fedlink job submit``; three ``fedlink runner`` processes train
on digits partitions; the model visits each of them once per round. Without the operator's allow, the
same submission is refused with FAILED_PRECONDITION naming the setting.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits

from bench.orphans import tied

pytestmark = pytest.mark.slow

FEDLINK = str(Path(sys.executable).parent / "fedlink")
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cyclic"
#: How long to wait for a process (or the job) to get somewhere: seconds on a quiet machine; far beyond
#: that, so that a loaded machine is no failure, and a hang still is one.
PROCESS_WAIT_S = 180.0


class Serve:
    """A ``fedlink serve`` process, and the CLI pointed at it."""

    def __init__(self, data_dir: Path, *args: str) -> None:
        self.data_dir = data_dir
        env = {k: v for k, v in os.environ.items() if not k.startswith("FEDLINK_")}
        env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        command = [FEDLINK, "serve", "--data-dir", str(data_dir), "--listen-address", "127.0.0.1:0"]
        command += ["--insecure", "--open-enrolment", "--reaper-interval", "200ms", *args]
        self.process = subprocess.Popen(
            tied(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        assert self.process.stdout is not None
        self.address = ""
        deadline = time.monotonic() + PROCESS_WAIT_S
        while not self.address and time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                raise AssertionError(f"fedlink serve exited with {self.process.wait()}")
            if " listening on " in line:
                self.address = line.split(" listening on ", 1)[1].split()[0]
        assert self.address, "fedlink serve did not report its address"

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FEDLINK_")}
        connection = ["--server", self.address, "--insecure", "--data-dir", str(self.data_dir)]
        return subprocess.run(
            tied([FEDLINK, "job", *args, *connection]),
            capture_output=True,
            text=True,
            env=env,
            timeout=PROCESS_WAIT_S,
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=PROCESS_WAIT_S)
        if self.process.stdout is not None:
            self.process.stdout.close()


@pytest.fixture
def digits(tmp_path: Path) -> Path:
    x, y = load_digits(return_X_y=True)
    path = tmp_path / "digits.npz"
    np.savez(path, x_train=(x / 16.0).astype(np.float32), y_train=y.astype(np.int64))
    return path


@pytest.fixture
def runners(tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=PROCESS_WAIT_S)


def test_the_cyclic_example_runs_under_serve_with_real_runners(
    tmp_path: Path, digits: Path, runners: list[subprocess.Popen[bytes]]
) -> None:
    serve = Serve(tmp_path / "coordinator", "--allow-workflows", "cyclic_workflow")
    try:
        submitted = serve.cli("submit", str(EXAMPLE / "job.toml"))
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip().splitlines()[-1]
        for i in range(3):
            command = [
                FEDLINK, "runner", "--server", serve.address, "--insecure",
                "--state-dir", str(tmp_path / f"runner-{i}"), "--data", str(digits),
                "--partition-id", str(i), "--num-partitions", "3", "--partition", "iid",
                "--task-wait", "2s",
            ]  # fmt: skip
            with (tmp_path / f"runner-{i}.log").open("ab") as log:
                runners.append(subprocess.Popen(tied(command), stdout=log, stderr=subprocess.STDOUT))

        deadline = time.monotonic() + 2 * PROCESS_WAIT_S
        while True:
            shown = serve.cli("show", job_id, "--format", "json")
            assert shown.returncode == 0, shown.stderr
            job = json.loads(shown.stdout)
            if job["state"] not in ("PENDING", "RUNNING"):
                break
            assert time.monotonic() < deadline, f"the cyclic job did not finish: {job}"
            time.sleep(0.5)
        assert job["state"] == "FINISHED", job
        assert job["workflow"] == "cyclic_workflow:cyclic"
        assert job["completed_rounds"] == job["current_round"] == 3
        assert job["num_rounds"] == 3  # the config's num_rounds, shown for a custom workflow too

        watched = serve.cli("watch", job_id, "--format", "json")
        assert watched.returncode == 0, watched.stderr
        events = [json.loads(line) for line in watched.stdout.splitlines()]
        closed = [e for e in events if e["event"] == "round_closed"]
        assert [(e["round"], e["num_results"]) for e in closed] == [(1, 3), (2, 3), (3, 3)]
        # The model went through every device, one after another: each device reported once a round.
        results = [e for e in events if e["event"] == "result_received"]
        for round_no in (1, 2, 3):
            assert len({e["device_id"] for e in results if e["round"] == round_no}) == 3

        model_path = tmp_path / "final.npz"
        downloaded = serve.cli("download", job_id, "-o", str(model_path))
        assert downloaded.returncode == 0, downloaded.stderr
        with np.load(model_path) as model:
            x, y = load_digits(return_X_y=True)
            accuracy = float(np.mean(np.argmax((x / 16.0) @ model["weight"] + model["bias"], axis=1) == y))
        assert accuracy > 0.9, (
            accuracy
        )  # it learnt (on the devices' own data: a check it ran, not a benchmark)
    finally:
        serve.stop()


def test_an_import_path_workflow_is_refused_unless_the_operator_allows_it(tmp_path: Path) -> None:
    serve = Serve(tmp_path / "coordinator")  # no --allow-workflows
    try:
        refused = serve.cli("submit", str(EXAMPLE / "job.toml"))
        assert refused.returncode == 1
        assert "FAILED_PRECONDITION" in refused.stderr
        assert "allow_workflows" in refused.stderr and "cyclic_workflow" in refused.stderr
        listed = serve.cli("list", "--format", "json")
        assert json.loads(listed.stdout) == []  # nothing was created
    finally:
        serve.stop()
