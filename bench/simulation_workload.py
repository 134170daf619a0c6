"""The simulation benchmark's FedAvg workload on fedlink: the job, the trivial trainer, the expected model.

The same workload as Flower's side (``bench/flower_app/run_config.py``, whose numpy-only arithmetic is
reused here so both sides check against one formula): every device every round, one float32 array,
and a training step that returns ``params + STEP * (partition_id + 1)`` as WEIGHTS with
``num_examples = partition_id + 1``. The trainer reaches the Runner the way an app's component does:
a type in a :class:`~fedlink.runner.config.ResolverRegistry`, named by the job's ``job_data``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from bench.flower_app.run_config import MODEL_KEY, STEP, expected_model, initial_model, tolerance
from fedlink.common.dxo import DXO, DataKind, MetaKey
from fedlink.runner.config import ResolverRegistry
from fedlink.runner.context import Context, ContextKey, Signal
from fedlink.server.workflows.fedavg import FedAvgParams
from fedlink.simulation import SimulationJob

__all__ = [
    "TRAINER_TYPE",
    "AddStep",
    "benchmark_job",
    "check_model",
    "expected_model",
    "registry",
    "tolerance",
]

#: The component type name the job's ``job_data`` uses for the trainer.
TRAINER_TYPE = "BenchAddStep"


class AddStep:
    """Flower's trivial step: ``params + STEP * (partition_id + 1)``, weighted by ``partition_id + 1``."""

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """Returns the shifted model as WEIGHTS (the task's arrays are shared and read-only: not touched)."""
        partition = int(ctx[ContextKey.PARTITION_ID])
        step = np.float32(STEP * (partition + 1))
        return DXO(
            kind=DataKind.WEIGHTS,
            data={name: array + step for name, array in dxo.data.items()},
            meta={MetaKey.NUM_EXAMPLES: partition + 1},
        )


def registry() -> ResolverRegistry:
    """The app's component types: just the trainer."""
    return ResolverRegistry({TRAINER_TYPE: AddStep})


def benchmark_job(floats: int, rounds: int, *, round_timeout_s: float = 3600.0) -> SimulationJob:
    """FedAvg over every device every round (``fraction=1``, no evaluation) on Flower's initial model."""
    return SimulationJob(
        name="bench-fedavg",
        workflow=FedAvgParams(num_rounds=rounds, fraction=1.0, round_timeout_s=round_timeout_s),
        model={MODEL_KEY: initial_model(floats)},
        job_data={
            "components": [{"type": TRAINER_TYPE, "name": "trainer"}],
            "executors": {"*": "@trainer"},
        },
    )


def check_model(arrays: dict[str, npt.NDArray[Any]], devices: int, floats: int, rounds: int) -> float:
    """The final model's largest absolute error against the exact expected value.

    Raises:
        ValueError: the model has the wrong variables or shape, or is off by more than the tolerance.
    """
    if set(arrays) != {MODEL_KEY} or arrays[MODEL_KEY].shape != (floats,):
        shapes = {k: v.shape for k, v in arrays.items()}
        raise ValueError(f"the final model is {shapes}, expected {{{MODEL_KEY!r}: ({floats},)}}")
    expected = expected_model(initial_model(floats), devices, rounds)
    error = float(np.max(np.abs(arrays[MODEL_KEY].astype(np.float64) - expected)))
    limit = tolerance(devices, rounds)
    if not error <= limit:
        raise ValueError(f"the final model is off by {error:.3g} (tolerance {limit:.3g})")
    return error
