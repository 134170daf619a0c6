"""The PyTorch example (``examples/pytorch``), run as a user runs it: one job file, simulated on 10
virtual devices and on ``fedlink serve`` with 4 device processes, reaching the accuracy its README
states, and the same final model bit for bit whichever way 4 devices run it.

Without torch these tests skip loudly; in CI (``CI`` set) torch must be there (``.ci/test`` installs
the CPU build).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if os.environ.get("CI") and importlib.util.find_spec("torch") is None:
    pytest.fail("torch is not installed in CI: .ci/test must install the CPU build", pytrace=False)
pytest.importorskip("torch", reason="the PyTorch example needs torch: pip install 'fedlink[torch]'")

from bench import orphans
from examples.pytorch import digits_cnn
from fedlink.runner.config import process_job_data
from fedlink.server.cli.jobfile import load_job_file

#: What examples/pytorch/README.md promises within the job's 20 rounds.
STATED_ACCURACY = 0.97
ROUNDS = 20


def run_example(repo_root: Path, cwd: Path, *args: str, timeout: float = 400) -> dict[str, Any]:
    """``examples/pytorch/run.py --json ARGS`` in a reaper (it starts processes of its own)."""
    command = orphans.reaped([sys.executable, str(repo_root / "examples/pytorch/run.py"), "--json", *args])
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        preexec_fn=orphans.dies_with_parent(signal.SIGTERM),
    )
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.terminate()  # SIGTERM: the reaper ends what the example started
        out, err = process.communicate()
        pytest.fail(f"run.py {' '.join(args)} did not finish in {timeout:g}s:\n{err}")
    assert process.returncode == 0, f"run.py {' '.join(args)} exited {process.returncode}:\n{err}"
    summary: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return summary


def test_the_job_file_names_a_trainer_a_runner_imports_once_allowed(
    repo_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = load_job_file(repo_root / "examples/pytorch/job.toml")
    monkeypatch.syspath_prepend(str(repo_root / "examples/pytorch"))  # as run.py gives the runners
    config = process_job_data(job.job_data, allow_components=["digits_cnn"])
    trainer = config.executor_for("train")
    assert type(trainer).__module__ == "digits_cnn"
    assert type(trainer).__name__ == digits_cnn.DigitsCNNTrainer.__name__
    assert config.executor_for("evaluate") is trainer
    assert job.workflow.config["num_rounds"] == ROUNDS
    assert digits_cnn.TRAINER_TYPE in job.job_data


def test_initial_npz_is_the_cnns_seeded_initialisation(repo_root: Path) -> None:
    expected = digits_cnn.initial_model()
    with np.load(repo_root / "examples/pytorch/initial.npz") as shipped:
        assert sorted(shipped.files) == sorted(expected), "run python examples/pytorch/digits_cnn.py"
        for name, array in expected.items():
            assert shipped[name].dtype == array.dtype and np.array_equal(shipped[name], array), (
                f"{name} differs: run python examples/pytorch/digits_cnn.py to rewrite initial.npz"
            )


@pytest.mark.slow
def test_simulated_on_10_devices_it_reaches_the_stated_accuracy(repo_root: Path, tmp_path: Path) -> None:
    summary = run_example(repo_root, tmp_path, "--mode", "simulate", "--devices", "10")
    assert len(summary["per_round"]) == ROUNDS
    assert summary["final"] >= STATED_ACCURACY, summary
    # The devices' evaluation of the last model is the accuracy computed from the model itself.
    assert summary["per_round"][-1] == pytest.approx(summary["final"])
    assert summary["per_round"][-1] > summary["per_round"][0]


@pytest.mark.slow
def test_serve_and_4_device_processes_reach_the_simulations_model_bit_for_bit(
    repo_root: Path, tmp_path: Path
) -> None:
    real = run_example(
        repo_root,
        tmp_path,
        "--mode",
        "processes",
        "--devices",
        "4",
        "--save-model",
        str(tmp_path / "real.npz"),
    )
    simulated = run_example(
        repo_root, tmp_path, "--mode", "simulate", "--devices", "4", "--save-model", str(tmp_path / "sim.npz")
    )
    assert real["final"] >= STATED_ACCURACY, real
    assert real["partition_sizes"] == simulated["partition_sizes"]
    assert real["per_round"] == simulated["per_round"]
    with np.load(tmp_path / "real.npz") as a, np.load(tmp_path / "sim.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for name in a.files:
            assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), f"{name} differs"
