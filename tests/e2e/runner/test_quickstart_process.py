"""The quickstart, run as a user runs it: its federated model is close to the centrally trained one."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from bench import orphans
from fedlink.common.dxo import DXO, DataKind
from fedlink.runner.context import Context, ContextKey, Signal
from fedlink.runner.data import ArrayDataSource
from fedlink.runner.executors import SoftmaxRegressionTrainer

pytestmark = pytest.mark.slow

#: The federated model must beat this on the held-out split whatever the centrally trained one does.
FLOOR = 0.90
ROUNDS = 10
#: ~12 s on a quiet machine; far more than it needs beside a heavy load.
RUN_TIMEOUT_S = 300


def load_quickstart(repo_root: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("quickstart_run", repo_root / "examples/quickstart/run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_quickstart(repo_root: Path, cwd: Path) -> tuple[int, str, str]:
    """Runs the quickstart to its end: its exit status, standard output and error.

    Through the reaper: the quickstart starts a coordinator and runners of its own, which no timeout
    of ours could otherwise end. Stopped with SIGTERM (never SIGKILL), so that the reaper ends them.
    """
    command = [
        sys.executable,
        str(repo_root / "examples/quickstart/run.py"),
        "--json",
        "--rounds",
        str(ROUNDS),
    ]
    process = subprocess.Popen(
        orphans.reaped(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )
    try:
        out, err = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.terminate()
        out, err = process.communicate()
        pytest.fail(f"the quickstart did not finish within {RUN_TIMEOUT_S} s:\n{err}")
    finally:
        if process.poll() is None:  # interrupted (pytest-timeout): the reaper ends the quickstart's tree
            process.terminate()
            process.wait()
    return process.returncode, out, err


# The quickstart's own limits (a job's round 60 s, its wait two minutes) end a stuck run before this.
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_the_quickstart_learns_as_well_as_central_training(repo_root: Path, tmp_path: Path) -> None:
    code, out, err = run_quickstart(repo_root, tmp_path)
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert len(summary["per_round"]) == ROUNDS
    assert summary["final"] == summary["per_round"][-1]

    # The same trainer, same args, on the union of the partitions, for as many epochs in total.
    quickstart = load_quickstart(repo_root)
    split = quickstart.split_digits(4, 0.5, 0)
    assert [len(y) for _, y in split.partitions] == summary["partition_sizes"]
    x = np.concatenate([p[0] for p in split.partitions])
    y = np.concatenate([p[1] for p in split.partitions])
    args = dict(quickstart.TRAINER_ARGS)
    args["epochs"] = args["epochs"] * ROUNDS
    trainer = SoftmaxRegressionTrainer(**args, data_source=ArrayDataSource({"train": (x, y)}))
    initial = {"weight": np.zeros((64, 10), np.float32), "bias": np.zeros((10,), np.float32)}
    ctx = Context()
    ctx[ContextKey.TASK_NAME] = "train"
    diff = trainer.execute(DXO(kind=DataKind.WEIGHTS, data=initial), ctx, Signal())
    central = DXO(kind=DataKind.WEIGHTS, data={k: initial[k] + diff.data[k] for k in initial})
    central_accuracy = quickstart.accuracy(central, split.x_test, split.y_test)

    assert summary["final"] >= FLOOR, summary
    assert summary["final"] >= central_accuracy - 0.03, (summary["final"], central_accuracy)
    assert summary["per_round"][-1] > summary["per_round"][0]  # it learned over the rounds
