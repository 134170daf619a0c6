"""Shared pieces of the simulation tests: the digits data, small jobs, executors that misbehave."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from fedlink.common.dxo import DXO, DataKind, MetaKey
from fedlink.runner.context import Context, ContextKey, Signal
from fedlink.runner.data import ArrayDataSource, PartitionedDataSource
from fedlink.server.workflows.fedavg import FedAvgParams
from fedlink.simulation import SimulationJob


class Digits:
    """Digits scaled to [0, 1], 25% held out (stratified), as in the runner quickstart."""

    def __init__(self) -> None:
        x, y = load_digits(return_X_y=True)
        x = (x / 16.0).astype(np.float32)
        y = y.astype(np.int64)
        self.x_train, self.x_test, self.y_train, self.y_test = train_test_split(
            x, y, test_size=0.25, stratify=y, random_state=0
        )

    def source(self, *, alpha: float = 0.5) -> PartitionedDataSource:
        """Label-skewed (Dirichlet) partitions of the training split, one per virtual device."""
        return PartitionedDataSource(
            ArrayDataSource({"train": (self.x_train, self.y_train)}), method="dirichlet", alpha=alpha, seed=0
        )

    def accuracy(self, arrays: dict[str, npt.NDArray[Any]]) -> float:
        """Held-out accuracy of a softmax regression model."""
        logits = self.x_test @ arrays["weight"] + arrays["bias"]
        return float(np.mean(np.argmax(logits, axis=1) == self.y_test))


@pytest.fixture(scope="session")
def digits() -> Digits:
    """The digits data, loaded once."""
    return Digits()


def softmax_job(*, rounds: int, epochs: int = 1, fraction: float = 1.0, **fedavg: Any) -> SimulationJob:
    """A FedAvg job training the built-in softmax regression on 64 features and 10 classes."""
    trainer = {"epochs": epochs, "learning_rate": 0.5, "batch_size": 8, "seed": 0}
    return SimulationJob(
        name="digits",
        workflow=FedAvgParams(num_rounds=rounds, fraction=fraction, round_timeout_s=60.0, **fedavg),
        model={"weight": np.zeros((64, 10), np.float32), "bias": np.zeros(10, np.float32)},
        job_data={"components": [{"type": "SoftmaxRegressionTrainer", "name": "trainer", "args": trainer}]},
    )


def small_model() -> dict[str, npt.NDArray[Any]]:
    """A model of one small variable."""
    return {"w": np.zeros(4, np.float32)}


class AddPartition:
    """Trains by adding ``0.01 * (partition id + 1)`` to every variable (one example per device)."""

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        step = 0.01 * (int(ctx[ContextKey.PARTITION_ID]) + 1)
        diff = {k: np.full(v.shape, step, v.dtype) for k, v in dxo.data.items()}
        return DXO(kind=DataKind.WEIGHT_DIFF, data=diff, meta={MetaKey.NUM_EXAMPLES: 1, "step": step})


class FailOnPartitions(AddPartition):
    """Like :class:`AddPartition`, but raises on the given partitions."""

    def __init__(self, failing: set[int]) -> None:
        self.failing = failing

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        if int(ctx[ContextKey.PARTITION_ID]) in self.failing:
            raise RuntimeError(f"sensor {ctx[ContextKey.PARTITION_ID]} unplugged")
        return super().execute(dxo, ctx, abort_signal)


class WritesIntoModel(AddPartition):
    """On partition 0, a buggy executor that changes the task's model in place; elsewhere AddPartition."""

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        if ctx[ContextKey.PARTITION_ID] == 0:
            dxo.data["w"] += 1.0
        return super().execute(dxo, ctx, abort_signal)


class Stalls:
    """Works until aborted (checks the abort signal), counting how many tasks it was stopped in."""

    def __init__(self) -> None:
        self.started = 0
        self.aborted = 0
        self._lock = threading.Condition()

    def wait_started(self, count: int, timeout: float) -> bool:
        """Blocks until ``count`` tasks are running (True) or ``timeout`` seconds passed (False)."""
        with self._lock:
            return self._lock.wait_for(lambda: self.started >= count, timeout)

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        with self._lock:
            self.started += 1
            self._lock.notify_all()
        while True:
            try:
                abort_signal.check()
            except Exception:
                with self._lock:
                    self.aborted += 1
                raise
            time.sleep(0.01)


def job_with(executor_model: dict[str, npt.NDArray[Any]] | None = None, **fedavg: Any) -> SimulationJob:
    """A job without job_data (the executor comes as ``runner=``)."""
    fedavg.setdefault("num_rounds", 1)
    fedavg.setdefault("round_timeout_s", 30.0)
    return SimulationJob(name="plain", workflow=FedAvgParams(**fedavg), model=executor_model or small_model())
