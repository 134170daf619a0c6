"""Every built-in strategy equals Flower 1.42's implementation on the same fixed updates.

The fixtures are Flower's own outputs (``fixtures/make_flower_fixtures.py`` made them, in a venv with
Flower). Each round is replayed through fedlink's real round path: the round's updates are offered to
the strategy's round holder as the report path offers them, the round closes, and its server step makes
the model, from the model Flower had at that round; the step's state goes on to the next round through a
checkpoint's serialized form, as a resumed coordinator would get it.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from fedlink.common.dxo import DXO, DataKind, MetaKey
from fedlink.server.domain import Task, TaskState, WorkflowSpec
from fedlink.server.workflows import registry
from fedlink.server.workflows.fedavg import FedAvgParams
from fedlink.server.workflows.folding import LazyModel
from fedlink.server.workflows.optimizers import OptimizerState

FIXTURES = Path(__file__).parent / "fixtures" / "flower"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
#: Flower's parameter names, where fedlink's differ.
RENAMED = {
    "eta": "server_learning_rate",
    "num_malicious_nodes": "num_malicious",
    "num_nodes_to_select": "num_to_select",
}
#: Flower's strategy, by fedlink's workflow name.
WORKFLOWS = {
    "FedAvg": "fedavg",
    "FedAvgM": "fedavgm",
    "FedAdam": "fedadam",
    "FedYogi": "fedyogi",
    "FedAdagrad": "fedadagrad",
    "FedMedian": "fedmedian",
    "FedTrimmedAvg": "fedtrimmedavg",
    "Krum": "krum",
    "MultiKrum": "krum",
}
CASES = sorted(p.stem for p in FIXTURES.glob("*.npz"))
Arrays = dict[str, npt.NDArray[Any]]


def _params(fixture: Any) -> FedAvgParams:
    flower = json.loads(str(fixture["params_json"]))
    name = WORKFLOWS[flower.pop("strategy")]
    config = {RENAMED.get(k, k): v for k, v in flower.items()}
    clients = int(fixture["num_clients"])
    spec = WorkflowSpec(name=name, config={"num_rounds": 3, "devices_per_round": clients, **config})
    params = registry.parse(spec)
    assert isinstance(params, FedAvgParams)
    return params


def _task(i: int) -> Task:
    return Task(
        task_id=f"task-{i:03d}",
        job_id="job",
        run_id="run",
        round=1,
        name="train",
        payload_sha256=None,
        deadline=T0 + timedelta(hours=1),
        slots=1,
        targeted=True,
        state=TaskState.OPEN,
        created_at=T0,
    )


def _arrays(fixture: Any, prefix: str) -> Arrays:
    return {name: np.asarray(fixture[f"{prefix}/{name}"]) for name in ("w", "b")}


def _through_a_checkpoint(state: OptimizerState) -> OptimizerState:
    """The state as a resumed coordinator reads it back: JSON values and a serialized DXO of arrays."""
    values = json.loads(json.dumps(dict(state.values), sort_keys=True))
    if not state.arrays:
        return OptimizerState(values=values)
    data = DXO(kind=DataKind.APP_DEFINED, data=dict(state.arrays)).to_bytes()
    return OptimizerState(values=values, arrays=DXO.from_bytes(data).data)


async def _round(
    params: FedAvgParams, state: OptimizerState, model: Arrays, updates: list[DXO], round_no: int
) -> tuple[Arrays, OptimizerState]:
    holder = params.round_rule()(LazyModel.of(model))
    tasks = [_task(i) for i in range(len(updates))]
    holder.expect(tasks, [f"dev-{i:03d}" for i in range(len(updates))])
    for task, update in zip(tasks, updates, strict=True):
        assert holder.offer(task.task_id, f"request-{task.task_id}", update)
        holder.settle(task.task_id, f"request-{task.task_id}", accepted=True)
        await holder.absorbed(task.task_id, patience=10.0)  # as the simulation's devices wait
    assert await holder.finish_if_all_folded(len(updates))
    step = params.server_step()
    step.restore(state)
    new = step.apply(model, holder.aggregate(), round_no=round_no)
    return new, step.state()


@pytest.mark.parametrize("case", CASES)
async def test_each_round_equals_flowers(case: str) -> None:
    fixture = np.load(FIXTURES / f"{case}.npz", allow_pickle=False)
    params = _params(fixture)
    state = OptimizerState()
    for round_no in range(1, int(fixture["num_rounds"]) + 1):
        model = _arrays(fixture, f"round{round_no}/model")
        updates = [
            DXO(
                kind=DataKind.WEIGHTS,
                data=_arrays(fixture, f"round{round_no}/client{i}"),
                meta={MetaKey.NUM_EXAMPLES: int(fixture[f"round{round_no}/client{i}/num_examples"])},
            )
            for i in range(int(fixture["num_clients"]))
        ]
        ours, state = await _round(params, _through_a_checkpoint(state), model, updates, round_no)
        flower = _arrays(fixture, f"round{round_no}/aggregate")
        for name, expected in flower.items():
            assert ours[name].dtype == model[name].dtype == np.float32  # Flower's FedAdam gives float64
            # Within float32 rounding: Flower computes in float32 (numpy's own order), fedlink in float64.
            np.testing.assert_allclose(
                ours[name], expected, rtol=2e-5, atol=2e-6, err_msg=f"{case} round {round_no} {name}"
            )


def test_every_built_in_strategy_has_a_flower_fixture() -> None:
    covered = {
        WORKFLOWS[json.loads(str(np.load(FIXTURES / f"{c}.npz")["params_json"]))["strategy"]] for c in CASES
    }
    # FedBuff has no rounds and no Flower counterpart: tests/server/workflows/test_fedbuff_*.py check it.
    assert covered == set(registry.BUILTIN) - {"fedbuff"}


def test_krum_takes_exactly_one_clients_update() -> None:
    fixture = np.load(FIXTURES / "krum.npz", allow_pickle=False)
    flower = _arrays(fixture, "round1/aggregate")
    clients = [_arrays(fixture, f"round1/client{i}") for i in range(int(fixture["num_clients"]))]
    assert any(all(np.array_equal(c[k], flower[k]) for k in flower) for c in clients)  # the fixture is Krum's
