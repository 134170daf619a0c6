"""RoundFold: results folded as they arrive give exactly the bits of folding the stored results in order.

The payloads live in a real SQLite blob store (the store's ``read_each`` is what the fold falls back
on); tasks and results are the domain values the store would list at the round's close.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedlink.common.dxo import DXO, DataKind, MetaKey
from fedlink.common.errors import FailedPrecondition
from fedlink.server.domain import ManualClock, Result, ResultStatus, Task, TaskState
from fedlink.server.domain.updates import model_spec
from fedlink.server.store import SqlStateStore, create_store
from fedlink.server.workflows.aggregation import apply_average
from fedlink.server.workflows.folding import LazyModel, MetricAverage, RoundFold, canonical_order

T0 = datetime(2026, 1, 1, tzinfo=UTC)
MODEL = {"w": np.linspace(-1, 1, 1000, dtype=np.float32), "b": np.arange(3, dtype=np.float32)}


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqlStateStore]:
    s = await create_store(
        f"sqlite+aiosqlite:///{tmp_path / 'fold.db'}",
        blob_dir=tmp_path / "blobs",
        clock=ManualClock(T0),
        auto_migrate=True,
    )
    yield s
    await s.close()


def _task(i: int, created: datetime = T0) -> Task:
    return Task(
        task_id=f"task-{i:03d}",
        job_id="job",
        run_id="run",
        round=1,
        name="train",
        payload_sha256=None,
        deadline=created + timedelta(hours=1),
        slots=1,
        targeted=True,
        state=TaskState.OPEN,
        created_at=created,
    )


def _device(i: int) -> str:
    return f"dev-{i:03d}"


def _update(i: int) -> DXO:
    """Device i's update: WEIGHTS for even i, WEIGHT_DIFF for odd i, distinct values and weights."""
    rng = np.random.default_rng(i)
    diff = {k: (rng.standard_normal(v.shape) * 0.01).astype(np.float32) for k, v in MODEL.items()}
    meta: dict[str, Any] = {MetaKey.NUM_EXAMPLES: 1 + 7 * i, "loss": 0.5 + i}
    if i % 2:
        return DXO(kind=DataKind.WEIGHT_DIFF, data=diff, meta=meta)
    return DXO(kind=DataKind.WEIGHTS, data={k: MODEL[k] + d for k, d in diff.items()}, meta=meta)


async def _result(store: SqlStateStore, i: int, *, kept: bool = True) -> Result:
    sha = (await store.blobs.put_bytes(_update(i).to_bytes())).sha256 if kept else None
    return Result(
        result_id=f"result-{i}",
        assignment_id=f"assignment-{i}",
        task_id=_task(i).task_id,
        device_id=_device(i),
        status=ResultStatus.SUCCEEDED,
        payload_sha256=sha,
        report_digest="d",
        error_message="",
        accepted=True,
        stale=False,
        request_id=f"request-{i}",
        created_at=T0,
    )


def _model(fold: RoundFold) -> dict[str, np.ndarray]:
    return dict(apply_average(MODEL, fold.average, is_diff=True))


async def _from_store_only(store: SqlStateStore, results: list[Result]) -> RoundFold:
    fold = RoundFold(MODEL, budget_bytes=1 << 30)
    await fold.finish(results, store.blobs.read_each)
    return fold


def _hand(fold: RoundFold, n: int, i: int) -> None:
    assert fold.offer(_task(i).task_id, f"request-{i}", _update(i))
    fold.settle(_task(i).task_id, f"request-{i}", accepted=True)


async def test_folding_as_results_arrive_gives_the_bits_of_folding_them_in_order(
    store: SqlStateStore,
) -> None:
    n = 12
    results = [await _result(store, i) for i in range(n)]
    tasks = {_task(i).task_id: _task(i) for i in range(n)}
    ordered = canonical_order(list(reversed(results)), tasks)
    assert [r.device_id for r in ordered] == [_device(i) for i in range(n)]
    reference = await _from_store_only(store, ordered)

    fold = RoundFold(MODEL, budget_bytes=1 << 30)
    fold.expect([_task(i) for i in range(n)], [_device(i) for i in range(n)])
    for i in [3, 1, 0, 2, 7, 5, 4, 6]:  # out of order: 0-7 fold once 0 is in; 8-11 never handed over
        _hand(fold, n, i)
    await asyncio.sleep(0)  # let the drainer run
    await fold.finish(ordered, store.blobs.read_each)
    for name in MODEL:
        np.testing.assert_array_equal(_model(fold)[name], _model(reference)[name])
    assert fold.metrics.result() == reference.metrics.result()
    assert fold.average.count == n
    # The float64 sums, where the order of the additions shows in the bits, against the same sums
    # done here in device order.
    for name, base in MODEL.items():
        total, weight = np.zeros(base.shape, np.float64), 0.0
        for i in range(n):
            update, w = _update(i), float(1 + 7 * i)
            diff = update.data[name]
            if update.kind is DataKind.WEIGHTS:
                diff = np.subtract(diff, base, dtype=np.float64).astype(base.dtype)
            total += diff.astype(np.float64) * w
            weight += w
        assert fold.average.result()[name].tobytes() == (total / weight).tobytes(), name


async def test_a_task_handed_out_with_an_earlier_place_makes_the_fold_start_again(
    store: SqlStateStore,
) -> None:
    results = [await _result(store, i) for i in range(4)]
    fold = RoundFold(MODEL, budget_bytes=1 << 30)
    fold.expect([_task(i) for i in (2, 3)], [_device(i) for i in (2, 3)])
    _hand(fold, 4, 2)
    await asyncio.sleep(0)
    # Tasks 0 and 1 come later but sort first (same creation time, lower device ids).
    fold.expect([_task(i) for i in (0, 1)], [_device(i) for i in (0, 1)])
    assert not fold.offer(_task(0).task_id, "request-0", _update(0))  # no more folding ahead
    await fold.finish(results, store.blobs.read_each)
    reference = await _from_store_only(store, results)
    for name in MODEL:
        np.testing.assert_array_equal(_model(fold)[name], _model(reference)[name])


async def test_a_payload_neither_kept_nor_held_is_an_error_not_a_silent_gap(store: SqlStateStore) -> None:
    results = [await _result(store, 0), await _result(store, 1, kept=False)]
    fold = RoundFold(MODEL, budget_bytes=1 << 30)
    with pytest.raises(FailedPrecondition, match="result-1 was not kept"):
        await fold.finish(results, store.blobs.read_each)


async def test_an_unkept_payload_held_by_the_fold_is_folded_from_memory(store: SqlStateStore) -> None:
    kept = [await _result(store, i) for i in range(3)]
    unkept = [await _result(store, i, kept=False) for i in range(3)]
    fold = RoundFold(MODEL, budget_bytes=1 << 30)
    fold.expect([_task(i) for i in range(3)], [_device(i) for i in range(3)])
    for i in (2, 1):  # held, waiting for device 0, when the round closes
        _hand(fold, 3, i)
    await asyncio.sleep(0)
    await fold.finish([kept[0], unkept[1], unkept[2]], store.blobs.read_each)
    reference = await _from_store_only(store, kept)
    for name in MODEL:
        np.testing.assert_array_equal(_model(fold)[name], _model(reference)[name])


async def test_what_the_fold_declines_and_releases(store: SqlStateStore) -> None:
    one = sum(int(a.nbytes) for a in MODEL.values())
    fold = RoundFold(MODEL, budget_bytes=2 * one)
    fold.expect([_task(i) for i in range(4)], [_device(i) for i in range(4)])
    assert not fold.offer("task-999", "r", _update(0))  # not handed out by this driver
    assert fold.offer(_task(1).task_id, "request-1", _update(1))
    assert not fold.offer(_task(1).task_id, "request-1b", _update(1))  # held already
    assert fold.offer(_task(2).task_id, "request-2", _update(2))
    assert not fold.offer(_task(3).task_id, "request-3", _update(3))  # over the budget
    fold.settle(_task(2).task_id, "request-2", accepted=False)  # e.g. stale: dropped, room again
    assert fold.offer(_task(3).task_id, "request-3", _update(3))
    fold.settle(_task(1).task_id, "other-request", accepted=True)  # not the held report: ignored
    results = [await _result(store, i) for i in range(4)]
    await fold.finish(results, store.blobs.read_each)
    reference = await _from_store_only(store, results)
    for name in MODEL:
        np.testing.assert_array_equal(_model(fold)[name], _model(reference)[name])


async def test_waiting_for_a_fold_ends_when_folded_or_when_the_fold_stalls(store: SqlStateStore) -> None:
    fold = RoundFold(MODEL, budget_bytes=1 << 30)
    fold.expect([_task(i) for i in range(3)], [_device(i) for i in range(3)])
    _hand(fold, 3, 1)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await fold.absorbed(_task(1).task_id, patience=0.2)  # waits for device 0's result, which never comes
    assert 0.15 <= loop.time() - started < 2.0
    waiter = asyncio.create_task(fold.absorbed(_task(2).task_id, patience=30.0))
    _hand(fold, 3, 2)
    await asyncio.sleep(0.05)
    assert not waiter.done()
    _hand(fold, 3, 0)  # 0, 1 and 2 fold now
    await asyncio.wait_for(waiter, 5.0)
    await fold.absorbed(_task(0).task_id, patience=30.0)  # folded already: returns at once


async def test_a_cancelled_waiter_does_not_end_another_wait_for_the_same_result(store: SqlStateStore) -> None:
    fold = RoundFold(MODEL, budget_bytes=1 << 30)
    fold.expect([_task(i) for i in range(2)], [_device(i) for i in range(2)])
    _hand(fold, 2, 1)  # waits behind device 0
    first = asyncio.create_task(fold.absorbed(_task(1).task_id, patience=30.0))
    second = asyncio.create_task(fold.absorbed(_task(1).task_id, patience=30.0))
    await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.sleep(0.01)
    assert first.cancelled() and not second.done()
    _hand(fold, 2, 0)  # 0 and 1 fold now
    await asyncio.wait_for(second, 5.0)


async def test_a_round_folded_whole_is_not_read_back_unless_the_store_counts_more(
    store: SqlStateStore,
) -> None:
    n = 6
    results = [await _result(store, i) for i in range(n)]
    reference = await _from_store_only(store, results)

    whole = RoundFold(MODEL, budget_bytes=1 << 30)
    whole.expect([_task(i) for i in range(n)], [_device(i) for i in range(n)])
    for i in reversed(range(n)):
        _hand(whole, n, i)
    await asyncio.sleep(0)
    assert await whole.finish_if_all_folded(n)
    assert whole.devices() == [_device(i) for i in range(n)]
    for name in MODEL:
        np.testing.assert_array_equal(_model(whole)[name], _model(reference)[name])

    # The store counts one more accepted result than was handed over (say, recorded by another
    # replica): the fold says so, and finishing from the store's list gets it.
    partial = RoundFold(MODEL, budget_bytes=1 << 30)
    partial.expect([_task(i) for i in range(n)], [_device(i) for i in range(n)])
    for i in range(n - 1):
        _hand(partial, n, i)
    await asyncio.sleep(0)
    assert not await partial.finish_if_all_folded(n)
    await partial.finish(results, store.blobs.read_each)
    assert partial.devices() == [_device(i) for i in range(n)]
    for name in MODEL:
        np.testing.assert_array_equal(_model(partial)[name], _model(reference)[name])


async def test_a_lazy_model_is_loaded_only_for_a_weights_result_and_once() -> None:
    loads = 0

    async def load() -> dict[str, np.ndarray]:
        nonlocal loads
        loads += 1
        await asyncio.sleep(0.01)  # the two WEIGHTS results below must share this load
        return MODEL

    later = T0 + timedelta(seconds=1)
    # In canonical order: devices 1 and 3 (WEIGHT_DIFF), then 0 and 2 (WEIGHTS, handed out later).
    order = [(_task(1), 1), (_task(3), 3), (_task(0, later), 0), (_task(2, later), 2)]
    lazy = RoundFold(LazyModel(model_spec(MODEL), load), budget_bytes=1 << 30)
    eager = RoundFold(MODEL, budget_bytes=1 << 30)
    for fold in (lazy, eager):
        fold.expect([t for t, _ in order], [_device(i) for _, i in order])

    def hand(fold: RoundFold, i: int) -> None:
        assert fold.offer(_task(i).task_id, f"request-{i}", _update(i))
        fold.settle(_task(i).task_id, f"request-{i}", accepted=True)

    for i in (1, 3):
        hand(lazy, i)
    await asyncio.sleep(0.05)
    assert lazy.average.count == 2 and loads == 0 and lazy.model.loaded is None  # folded without it
    for i in (0, 2):
        hand(lazy, i)
    for i in (1, 3, 0, 2):
        hand(eager, i)
    await asyncio.sleep(0.1)
    for fold in (lazy, eager):
        assert await fold.finish_if_all_folded(4)
    assert loads == 1 and lazy.model.loaded is MODEL
    for name in MODEL:
        assert lazy.average.result()[name].tobytes() == eager.average.result()[name].tobytes()


async def test_a_failed_model_load_is_tried_again() -> None:
    attempts = 0

    async def load() -> dict[str, np.ndarray]:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise OSError("blob store unavailable")
        return MODEL

    model = LazyModel(model_spec(MODEL), load)
    with pytest.raises(OSError, match="unavailable"):
        await model.arrays()
    assert await model.arrays() is MODEL and attempts == 2


def test_metric_means_are_the_same_bits_in_any_order() -> None:
    rng = np.random.default_rng(5)
    # Decimals of very different sizes: a plain float sum of these depends on the order of its terms.
    metas = [
        {"loss": float(v), "acc": float(a)}
        for v, a in zip(rng.lognormal(0, 6, 200), rng.random(200), strict=True)
    ]
    weights = [float(w) for w in rng.integers(1, 1000, 200)]

    def means(order: list[int]) -> dict[str, float]:
        average = MetricAverage()
        for i in order:
            average.add(metas[i], weights[i])
        return average.result()

    forward = means(list(range(200)))
    exact = math.fsum(w * m["loss"] for w, m in zip(weights, metas, strict=True)) / math.fsum(weights)
    assert forward["loss"] == exact  # correctly rounded, not merely close
    naive: set[float] = set()
    for seed in range(5):
        order = [int(i) for i in np.random.default_rng(seed).permutation(200)]
        assert means(order) == forward, seed
        naive.add(sum(weights[i] * metas[i]["loss"] for i in order))
    assert len(naive) > 1  # the terms are ones whose plain sum the order changes


def test_metric_means_skip_what_is_not_a_finite_number() -> None:
    average = MetricAverage()
    average.add({"loss": 1.0, "flag": True, "name": "x", "num_examples": 5, "bad": math.nan}, 2.0)
    average.add({"loss": 4.0, "bad": 1e308}, 10.0)  # 1e309 overflows: skipped, not an inf mean
    assert average.result() == {"loss": 3.5}
