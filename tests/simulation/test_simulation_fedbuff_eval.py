"""FedBuff's evaluation every ``eval_frequency`` versions, on the simulation: the evaluated versions'
events carry the devices' metrics (prefixed ``eval_``, of that version's model), the others none, and
training makes the same model to the bit as without evaluation, failed evaluations included."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

from fedlink.common.dxo import DXO, DataKind, MetaKey
from fedlink.common.errors import InvalidArgument
from fedlink.runner.context import Context, ContextKey, Signal
from fedlink.server.workflows.fedbuff import FedBuffParams
from fedlink.simulation import SimulationJob, SimulationResult, run_simulation

from .conftest import AddPartition

DEVICES = 6
VERSIONS = 6
#: Each version adds the mean of the devices' steps 0.01 (i + 1): 0.035.
STEP = 0.035


class TrainsAndEvaluates(AddPartition):
    """Trains as AddPartition; evaluates by reporting the mean of the model it was sent and the version
    the coordinator said it is, as 0-d data (as the built-in trainers send their metrics)."""

    def __init__(self, *, failing: bool = False) -> None:
        self.failing = failing

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        if ctx[ContextKey.TASK_NAME] != "evaluate":
            return super().execute(dxo, ctx, abort_signal)
        if self.failing:
            raise RuntimeError("no test data on this device")
        data = {
            "w_mean": np.asarray(np.mean(dxo.data["w"], dtype=np.float64)),
            "version": np.asarray(dxo.meta[MetaKey.MODEL_VERSION], dtype=np.float64),
        }
        return DXO(kind=DataKind.METRICS, data=data, meta={MetaKey.NUM_EXAMPLES: 1})


def _params(**evaluation: Any) -> FedBuffParams:
    """FedBuff as synchronous rounds of every device (each version: every device's update on the last
    one), so that the versions' updates do not depend on timing and two runs can be compared bit for bit."""
    return FedBuffParams(
        max_model_version=VERSIONS,
        device_selection_size=DEVICES,
        num_updates_for_model=DEVICES,
        min_hole_to_fill=DEVICES,
        max_model_history=1,
        device_sampling_strategy="random",
        seed=3,
        **evaluation,
    )


def _run(params: FedBuffParams, executor: TrainsAndEvaluates) -> SimulationResult:
    job = SimulationJob(name="evaluated", workflow=params, model={"w": np.zeros(5, np.float32)})
    return run_simulation(job, DEVICES, runner=executor, seed=0)


def _training(metrics: Mapping[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith("eval_")}


def test_every_second_version_is_evaluated_and_training_is_unchanged_to_the_bit() -> None:
    plain = _run(_params(), TrainsAndEvaluates())
    evaluated = _run(_params(eval_frequency=2, eval_devices=3), TrainsAndEvaluates())

    assert [r.round for r in evaluated.rounds] == list(range(1, VERSIONS + 1))  # events in version order
    for record in evaluated.rounds:
        eval_keys = sorted(k for k in record.metrics if k.startswith("eval_"))
        if record.round % 2:
            assert eval_keys == [], (record.round, record.metrics)
            continue
        assert eval_keys == ["eval_version", "eval_w_mean"], (record.round, record.metrics)
        # the version's own model was evaluated, not the one before or after it
        assert record.metrics["eval_version"] == record.round
        assert record.metrics["eval_w_mean"] == pytest.approx(STEP * record.round, rel=1e-5)
    # evaluation results are never updates: each version is still every device's update
    assert [r.num_results for r in evaluated.rounds] == [DEVICES] * VERSIONS
    assert [_training(r.metrics) for r in evaluated.rounds] == [_training(r.metrics) for r in plain.rounds]
    assert evaluated.arrays["w"].dtype == plain.arrays["w"].dtype
    assert np.array_equal(evaluated.arrays["w"], plain.arrays["w"])
    assert float(plain.arrays["w"][0]) == pytest.approx(STEP * VERSIONS, rel=1e-5)


def test_failed_evaluations_leave_their_versions_without_eval_metrics() -> None:
    plain = _run(_params(), TrainsAndEvaluates())
    failed = _run(_params(eval_frequency=3, eval_devices=2), TrainsAndEvaluates(failing=True))

    assert [r.round for r in failed.rounds] == list(range(1, VERSIONS + 1))
    assert all(not k.startswith("eval_") for r in failed.rounds for k in r.metrics)
    assert np.array_equal(failed.arrays["w"], plain.arrays["w"])


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("eval_frequency", -1, "eval_frequency must not be negative"),
        ("eval_devices", 0, "eval_devices must be at least 1"),
    ],
)
def test_bad_evaluation_parameters_are_refused_naming_them(field: str, value: int, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        _params(**{field: value})
    config = dataclasses.replace(_params(), eval_frequency=2).to_config() | {field: value}
    with pytest.raises(InvalidArgument, match=f"fedbuff.{message}"):
        FedBuffParams.from_config(config, section="fedbuff")


def test_evaluation_asks_for_an_evaluate_executor() -> None:
    assert _params().task_names == ("train",)
    assert _params(eval_frequency=2).task_names == ("train", "evaluate")
    assert [v for v in range(13) if _params(eval_frequency=4).evaluates(v)] == [4, 8, 12]
