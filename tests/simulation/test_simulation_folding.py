"""Results folded in-process: a throwaway store keeps their metadata only, and the model is the same bits."""

from __future__ import annotations

import shutil
import sqlite3
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedlink.common.dxo import DXO, DataKind, MetaKey
from fedlink.runner.context import Context, ContextKey, Signal
from fedlink.simulation import Heterogeneity, SimulationResult, engine, run_simulation

from .conftest import job_with

MODEL = {"w": np.linspace(-1.0, 1.0, 3000, dtype=np.float32), "b": np.zeros(7, np.float32)}


class DistinctWeights:
    """Returns WEIGHTS (even partitions) or a WEIGHT_DIFF (odd ones) of seeded noise, distinct weights;
    keeps what each partition returned, in order."""

    def __init__(self) -> None:
        self.made: dict[int, list[DXO]] = defaultdict(list)

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        out = self._make(dxo, ctx)
        self.made[int(ctx[ContextKey.PARTITION_ID])].append(out)  # one task per device at a time
        return out

    def _make(self, dxo: DXO, ctx: Context) -> DXO:
        partition = int(ctx[ContextKey.PARTITION_ID])
        version = dxo.meta.get(MetaKey.MODEL_VERSION, 0)
        assert isinstance(version, int)
        rng = np.random.default_rng([partition, version])
        diff = {k: (rng.standard_normal(v.shape) * 0.01).astype(v.dtype) for k, v in dxo.data.items()}
        meta: dict[str, Any] = {MetaKey.NUM_EXAMPLES: 1 + 3 * partition, "loss": float(partition)}
        if partition % 2:
            return DXO(kind=DataKind.WEIGHT_DIFF, data=diff, meta=meta)
        return DXO(kind=DataKind.WEIGHTS, data={k: dxo.data[k] + d for k, d in diff.items()}, meta=meta)


def _run(
    tmp_path: Path, store: str | Path, hetero: Heterogeneity | None, executor: DistinctWeights | None = None
) -> SimulationResult:
    job = job_with(dict(MODEL), num_rounds=3, devices_per_round=24, min_results=24)
    return run_simulation(
        job, 40, runner=executor or DistinctWeights(), store=store, heterogeneity=hetero, seed=5, timeout=120
    )


def _fedavg_by_hand(result: SimulationResult, made: dict[int, list[DXO]]) -> dict[str, np.ndarray]:
    """FedAvg of what each device returned: float64 sums of float32 differences in device order."""
    model = {k: v.copy() for k, v in MODEL.items()}
    for round_no in (1, 2, 3):
        devices = sorted(i for i, rounds in result.participation.items() if round_no in rounds)
        updates = [(made[i][result.participation[i].index(round_no)]) for i in devices]
        weights = [float(u.meta[MetaKey.NUM_EXAMPLES]) for u in updates]  # type: ignore[arg-type]
        for name, base in model.items():
            total = np.zeros(base.shape, np.float64)
            for update, weight in zip(updates, weights, strict=True):
                diff = update.data[name]
                if update.kind is DataKind.WEIGHTS:
                    diff = np.subtract(diff, base, dtype=np.float64).astype(base.dtype)
                total += diff.astype(np.float64) * weight
            model[name] = (base.astype(np.float64) + total / sum(weights)).astype(base.dtype)
    return model


@pytest.mark.parametrize(
    "hetero",
    # Link delays make results arrive out of order: the fold holds them until their turn. (Not drop-outs:
    # which device replaces a dropped one depends on timing, so such runs differ from each other.)
    [None, Heterogeneity(slowdown=(1.0, 3.0), link_delay_s=(0.0, 0.05))],
    ids=["in-order", "stragglers"],
)
def test_a_throwaway_store_keeps_metadata_only_and_gives_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hetero: Heterogeneity | None
) -> None:
    executor = DistinctWeights()
    kept = _run(tmp_path, tmp_path / "kept.db", hetero, executor)
    # The bits FedAvg must give, computed here from what the devices returned (a fold that lost, doubled
    # or misweighted a result fails here whatever the two stores agree on; the order of the float64 sums
    # is checked in tests/server/workflows/test_folding.py, where it shows in the bits).
    for name, expected in _fedavg_by_hand(kept, executor.made).items():
        assert kept.arrays[name].tobytes() == expected.tobytes(), name
    workdirs: list[Path] = []

    def keep_for_inspection(path: Path) -> threading.Thread:
        workdirs.append(path)
        return threading.Thread()

    monkeypatch.setattr(engine, "remove_in_background", keep_for_inspection)
    thrown = _run(tmp_path, ":memory:", hetero)
    try:
        assert thrown.model.to_bytes() == kept.model.to_bytes()
        assert [r.metrics for r in thrown.rounds] == [r.metrics for r in kept.rounds]
        assert thrown.participation == kept.participation
        counted = _results_stored(workdirs[0] / "simulation.db")
        with sqlite3.connect(workdirs[0] / "simulation.db") as db:
            blobs = db.execute("SELECT count(*) FROM blobs").fetchone()[0]
        assert counted[0] == sum(r.num_results for r in thrown.rounds) == 72
        # The fold took every result: none was stored, only the initial model and one per round are.
        assert counted[1] == 0, counted
        assert blobs == 1 + 3
    finally:
        for path in workdirs:
            shutil.rmtree(path, ignore_errors=True)


def _results_stored(db_path: Path) -> tuple[int, int]:
    with sqlite3.connect(db_path) as db:
        row: tuple[int, int] = db.execute(
            "SELECT count(*), count(payload_sha256) FROM results WHERE status = 'SUCCEEDED' AND accepted"
        ).fetchone()
    return row


def test_a_store_kept_for_inspection_keeps_every_payload(tmp_path: Path) -> None:
    _run(tmp_path, tmp_path / "kept.db", None)
    total, with_payload = _results_stored(tmp_path / "kept.db")
    assert total == with_payload == 72
