"""BufferedRound: the robust rules' holder of a round's updates, checked against numpy.

The payloads live in a real SQLite blob store (what ``finish`` reads the results not held from); tasks
and results are the domain values the store would list at the round's close. Tasks are created at
three instants, so the canonical order (creation time, then device) is not the order of the ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedlink.common.dxo import DXO, DataKind, MetaKey
from fedlink.common.errors import FailedPrecondition
from fedlink.server.domain import ManualClock, Result, ResultStatus, Task, TaskState
from fedlink.server.store import SqlStateStore, create_store
from fedlink.server.workflows.folding import LazyModel
from fedlink.server.workflows.robust import (
    BufferedRound,
    FedMedianParams,
    FedTrimmedAvgParams,
    KrumParams,
    RobustAggregate,
    RobustParams,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
MODEL = {"w": np.linspace(-1, 1, 1000, dtype=np.float32), "b": np.arange(3, dtype=np.float32)}
N = 7
OUTLIERS = {2, 5}  # scaled up: what Krum is there to leave out
RULES = ["median", "trimmed", "krum", "multikrum"]
Rows = dict[str, np.ndarray]


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqlStateStore]:
    s = await create_store(
        f"sqlite+aiosqlite:///{tmp_path / 'robust.db'}",
        blob_dir=tmp_path / "blobs",
        clock=ManualClock(T0),
        auto_migrate=True,
    )
    yield s
    await s.close()


def _params(rule: str, capacity: int) -> RobustParams:
    if rule == "median":
        return FedMedianParams(num_rounds=1, devices_per_round=capacity)
    if rule == "trimmed":
        return FedTrimmedAvgParams(num_rounds=1, devices_per_round=capacity, beta=0.2)
    f, m = (2, 1) if rule == "krum" else (1, 3)
    return KrumParams(num_rounds=1, devices_per_round=capacity, num_malicious=f, num_to_select=m)


def _canonical(ids: Iterable[int]) -> list[int]:
    return sorted(ids, key=lambda i: (i % 3, _device(i)))


def _task(i: int) -> Task:
    created = T0 + timedelta(seconds=i % 3)
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


def _update(i: int, without: Iterable[str] = ()) -> DXO:
    """Device i's update: WEIGHTS for even i, WEIGHT_DIFF for odd i, distinct values and weights."""
    rng = np.random.default_rng(i)
    scale = 0.5 if i in OUTLIERS else 0.01
    diff = {
        k: (rng.standard_normal(v.shape) * scale).astype(np.float32)
        for k, v in MODEL.items()
        if k not in without
    }
    meta: dict[str, Any] = {MetaKey.NUM_EXAMPLES: 1 + 7 * i, "loss": 0.5 + i}
    if i % 2:
        return DXO(kind=DataKind.WEIGHT_DIFF, data=diff, meta=meta)
    return DXO(kind=DataKind.WEIGHTS, data={k: MODEL[k] + d for k, d in diff.items()}, meta=meta)


def _row(i: int, without: Iterable[str] = ()) -> Rows:
    """Device i's update as the float32 difference to the model it should be held as."""
    update = _update(i, without)
    if update.kind is DataKind.WEIGHT_DIFF:
        return dict(update.data)
    return {k: np.subtract(v, MODEL[k]) for k, v in update.data.items()}


async def _result(store: SqlStateStore, i: int, *, kept: bool = True, without: Iterable[str] = ()) -> Result:
    sha = (await store.blobs.put_bytes(_update(i, without).to_bytes())).sha256 if kept else None
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


def _open(params: RobustParams, ids: Iterable[int] = range(N)) -> BufferedRound:
    holder = params.round_rule()(LazyModel.of(MODEL))
    assert isinstance(holder, BufferedRound)
    ids = list(ids)
    holder.expect([_task(i) for i in ids], [_device(i) for i in ids])
    return holder


def _offer(holder: BufferedRound, i: int, without: Iterable[str] = ()) -> bool:
    return holder.offer(_task(i).task_id, f"request-{i}", _update(i, without))


def _hand(holder: BufferedRound, i: int, without: Iterable[str] = ()) -> None:
    assert _offer(holder, i, without)
    holder.settle(_task(i).task_id, f"request-{i}", accepted=True)


def _flat(aggregate: RobustAggregate) -> Rows:
    out: Rows = {}
    for name in sorted(aggregate.covered()):
        parts: list[np.ndarray] = []
        for start, block in aggregate.steps(name):
            assert start == sum(p.size for p in parts)
            parts.append(block.copy())  # a step's block may be scratch the next one reuses
        out[name] = np.concatenate(parts)
    return out


def _bits(holder: BufferedRound) -> tuple[bytes, ...]:
    return tuple(n.encode() + v.tobytes() for n, v in _flat(holder.aggregate()).items())


def _expected(params: RobustParams, rows: Sequence[Rows], weights: Sequence[float]) -> Rows:
    """The rule computed here over ``rows`` (canonical order), directly in float64."""
    names = sorted({k for r in rows for k in r})
    if isinstance(params, KrumParams):  # whole updates: a variable left out is a row of zeros
        full = [
            np.concatenate([r.get(k, np.zeros_like(MODEL[k])).astype(np.float64) for k in names])
            for r in rows
        ]
        n = len(full)
        dist = [[float(np.sum((a - b) ** 2)) for b in full] for a in full]
        closest = max(1, n - params.num_malicious - 2)
        scores = [sum(sorted(dist[i][j] for j in range(n) if j != i)[:closest]) for i in range(n)]
        chosen = sorted(sorted(range(n), key=lambda i: (scores[i], i))[: params.num_to_select])
        total = sum(weights[i] * full[i] for i in chosen)
        mean = total / sum(weights[i] for i in chosen)
        sizes = np.cumsum([MODEL[k].size for k in names])[:-1]
        return dict(zip(names, np.split(mean, sizes), strict=True))
    out: Rows = {}
    for k in names:
        stack = np.stack([r[k].astype(np.float64).ravel() for r in rows if k in r])
        if isinstance(params, FedTrimmedAvgParams):
            cut = int(params.beta * len(stack))
            out[k] = np.sort(stack, axis=0)[cut : len(stack) - cut].mean(axis=0)
        else:
            out[k] = np.median(stack, axis=0)
    return out


def _check(
    params: RobustParams, holder: BufferedRound, rows: Sequence[Rows], weights: Sequence[float]
) -> None:
    ours, expected = _flat(holder.aggregate()), _expected(params, rows, weights)
    assert ours.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(params, KrumParams):  # a weighted mean: float64 sums in another order
            np.testing.assert_allclose(ours[name], value, rtol=1e-12, atol=1e-15, err_msg=name)
        else:  # the same values sorted (or selected): exact
            np.testing.assert_array_equal(ours[name], value, err_msg=name)


def _weight(i: int) -> float:
    return float(1 + 7 * i)


@pytest.mark.parametrize("rule", RULES)
async def test_the_aggregate_does_not_depend_on_the_order_of_arrival(rule: str) -> None:
    params, canonical = _params(rule, N), _canonical(range(N))
    seen = set()
    for order in ([0, 1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1, 0], [4, 0, 6, 2, 5, 1, 3]):
        holder = _open(params, order)
        for k, i in enumerate(order):
            _hand(holder, i)
            if k % 3 == 2:
                await asyncio.sleep(0)  # the copier runs between some arrivals, not others
        assert await holder.finish_if_all_folded(N)
        assert holder.devices() == [_device(i) for i in canonical] and holder.count == N
        seen.add((_bits(holder), tuple(holder.metrics.result().items())))
    assert len(seen) == 1
    _check(params, holder, [_row(i) for i in canonical], [_weight(i) for i in canonical])


async def test_krum_breaks_a_tie_by_the_canonical_order_not_by_arrival() -> None:
    params = KrumParams(num_rounds=1, devices_per_round=4, num_malicious=0, num_to_select=1)
    assert _canonical([1, 2, 3, 4])[0] == 3
    for order in ([1, 2, 3, 4], [4, 2, 1, 3]):
        holder = _open(params, order)
        for i in order:  # one-hot differences: every two are 2.0 apart, exactly, so all scores tie
            w = np.zeros_like(MODEL["w"])
            w[i] = 1.0
            update = DXO(kind=DataKind.WEIGHT_DIFF, data={"w": w}, meta={MetaKey.NUM_EXAMPLES: i})
            assert holder.offer(_task(i).task_id, f"request-{i}", update)
            holder.settle(_task(i).task_id, f"request-{i}", accepted=True)
        assert await holder.finish_if_all_folded(4)
        assert np.flatnonzero(_flat(holder.aggregate())["w"]).tolist() == [3]


@pytest.mark.parametrize("rule", RULES)
async def test_a_rejected_update_is_dropped_and_frees_its_room(store: SqlStateStore, rule: str) -> None:
    params = _params(rule, 4)
    holder = _open(params, range(5))
    for i in range(4):
        assert _offer(holder, i)
    assert not _offer(holder, 4)  # full
    holder.settle(_task(2).task_id, "request-2", accepted=False)  # e.g. stale: dropped
    holder.settle(_task(1).task_id, "other-request", accepted=True)  # not the held report: ignored
    assert _offer(holder, 4)
    for i in (0, 1, 3, 4):
        holder.settle(_task(i).task_id, f"request-{i}", accepted=True)
    assert await holder.finish_if_all_folded(4)
    taken = _canonical([0, 1, 3, 4])
    assert holder.devices() == [_device(i) for i in taken]
    _check(params, holder, [_row(i) for i in taken], [_weight(i) for i in taken])
    reference = _open(params, range(5))
    await reference.finish([await _result(store, i) for i in taken], store.blobs.read_each)
    assert _bits(holder) == _bits(reference)


@pytest.mark.parametrize("rule", RULES)
async def test_held_copied_and_stored_results_give_the_same_bits(store: SqlStateStore, rule: str) -> None:
    params, canonical = _params(rule, N), _canonical(range(N))
    kept = [await _result(store, i) for i in canonical]
    unkept = {i: await _result(store, i, kept=False) for i in canonical}  # only memory can give these
    from_store = _open(params)
    await from_store.finish(kept, store.blobs.read_each)

    all_held = _open(params)
    for i in reversed(range(N)):
        _hand(all_held, i)
    await all_held.finish([unkept[i] for i in canonical], store.blobs.read_each)

    mixed = _open(params)
    for i in (5, 1, 3):
        _hand(mixed, i)
    await asyncio.sleep(0)  # copied into the rows
    assert _offer(mixed, 6)  # held, its settle not seen before the close
    # Device 0's report held here is not the one the store accepted (another request): not taken.
    assert mixed.offer(_task(0).task_id, "request-0-old", _update(2))
    mixed.settle(_task(0).task_id, "request-0-old", accepted=True)
    await mixed.finish(
        [unkept[i] if i in (1, 3, 5, 6) else r for i, r in zip(canonical, kept, strict=True)],
        store.blobs.read_each,
    )

    rounds = (from_store, all_held, mixed)
    for holder in rounds:
        assert holder.devices() == [_device(i) for i in canonical]
        assert holder.metrics.result() == from_store.metrics.result()
    assert len({_bits(h) for h in rounds}) == 1
    _check(params, mixed, [_row(i) for i in canonical], [_weight(i) for i in canonical])


@pytest.mark.parametrize("rule", RULES)
async def test_an_untaken_held_update_is_dropped_and_its_slot_reused(store: SqlStateStore, rule: str) -> None:
    params = _params(rule, 3)
    holder = _open(params, range(N))
    for i in (1, 0, 4):  # slots 0, 1, 2
        _hand(holder, i)
    await asyncio.sleep(0)
    # In canonical order 0, 3, 6, 1, 4 would be: 4 is not listed (say, stale), 1 is past the capacity.
    # Their slots (both with a "b" row) go to 3 and 6 from the store; 6 carries no "b".
    results = [await _result(store, 0), await _result(store, 3), await _result(store, 6, without=["b"])]
    await holder.finish([*results, await _result(store, 1)], store.blobs.read_each)
    assert holder.devices() == [_device(i) for i in (0, 3, 6)] and holder.count == 3
    rows = [_row(0), _row(3), _row(6, without=["b"])]  # for Krum, 6's "b" is a row of zeros
    _check(params, holder, rows, [_weight(i) for i in (0, 3, 6)])  # median, trimmed: "b" over 0 and 3


@pytest.mark.parametrize("rule", RULES)
async def test_fewer_results_than_the_room_come_from_any_slot(store: SqlStateStore, rule: str) -> None:
    params = _params(rule, 5)
    holder = _open(params, range(5))
    for i in (1, 0, 2, 4):  # slots 0-3
        _hand(holder, i)
    _hand(holder, 3, without=["b"])  # slot 4
    await asyncio.sleep(0)
    # 1 and 2 not listed: 0, 3 and 4 are taken from slots 1, 4 and 3 (for Krum: in that order).
    results = [await _result(store, i, without=["b"] if i == 3 else ()) for i in (0, 3, 4)]
    await holder.finish(results, store.blobs.read_each)
    reference = _open(params, range(5))
    await reference.finish(results, store.blobs.read_each)
    assert _bits(holder) == _bits(reference) and holder.devices() == [_device(i) for i in (0, 3, 4)]
    _check(params, holder, [_row(0), _row(3, ["b"]), _row(4)], [_weight(i) for i in (0, 3, 4)])


@pytest.mark.parametrize("rule", ["median", "trimmed"])
async def test_a_variable_left_out_is_aggregated_over_those_carrying_it(
    store: SqlStateStore, rule: str
) -> None:
    params, canonical = _params(rule, N), _canonical(range(N))
    without = {3: ["b"], 5: ["b"], 4: ["w"]}  # "b" over 5 results, "w" over 6
    holder = _open(params)
    for i in (3, 4, 0):
        _hand(holder, i, without.get(i, ()))
    await asyncio.sleep(0)
    await holder.finish(
        [await _result(store, i, without=without.get(i, ())) for i in canonical], store.blobs.read_each
    )
    _check(params, holder, [_row(i, without.get(i, ())) for i in canonical], [_weight(i) for i in canonical])
    everything = _expected(params, [_row(i) for i in canonical], [_weight(i) for i in canonical])
    assert not np.array_equal(_flat(holder.aggregate())["b"], everything["b"])


@pytest.mark.parametrize("rule", RULES)
async def test_what_the_round_declines(store: SqlStateStore, rule: str) -> None:
    holder = _open(_params(rule, 3), range(5))
    with pytest.raises(FailedPrecondition):
        holder.aggregate()  # not closed yet
    assert not holder.offer("task-999", "r", _update(0))  # not handed out this round
    assert _offer(holder, 0)
    assert not holder.offer(_task(0).task_id, "request-0b", _update(0))  # held already
    holder.settle(_task(0).task_id, "request-0", accepted=True)
    await asyncio.sleep(0)
    assert not holder.offer(_task(0).task_id, "request-0c", _update(0))  # copied already
    assert _offer(holder, 1) and _offer(holder, 2)
    assert not _offer(holder, 3)  # beyond the capacity
    assert not await holder.finish_if_all_folded(3)  # 1 and 2 not settled: the close goes on
    holder.settle(_task(2).task_id, "request-2", accepted=False)  # room again, but closed
    assert not _offer(holder, 3)
    # The store lists 2 all the same (say, another replica took it), without its payload: 0 and 1
    # are in memory, 2 nowhere.
    results = [await _result(store, i, kept=False) for i in range(3)]
    with pytest.raises(FailedPrecondition, match="result-2 was not kept"):
        await holder.finish(results, store.blobs.read_each)


@pytest.mark.parametrize("rule", RULES)
async def test_a_settle_after_the_close_began_changes_nothing(store: SqlStateStore, rule: str) -> None:
    params, canonical = _params(rule, N), _canonical(range(N))
    listed = [i for i in canonical if i != 2]  # 2's result the store did not accept (say, stale)
    holder = _open(params)
    for i in (0, 3, 6, 1):
        _hand(holder, i)
    assert _offer(holder, 4) and _offer(holder, 2)  # their settles come during the close
    assert not await holder.finish_if_all_folded(len(listed))  # the close begins: 4 not copied
    holder.settle(_task(2).task_id, "request-2", accepted=True)
    await asyncio.sleep(0.01)

    async def read_each(shas: Sequence[str]) -> AsyncIterator[bytes]:
        for i in (4, 2):
            holder.settle(_task(i).task_id, f"request-{i}", accepted=True)
        await asyncio.sleep(0.01)  # a copier started now would run here
        async for payload in store.blobs.read_each(shas):
            yield payload

    results = [await _result(store, i, kept=i != 4) for i in listed]
    await holder.finish(results, read_each)
    reference = _open(params)
    await reference.finish([await _result(store, i) for i in listed], store.blobs.read_each)
    bits = _bits(holder)
    assert bits == _bits(reference) and holder.devices() == [_device(i) for i in listed]
    for i in (2, 4):  # again, after the close
        holder.settle(_task(i).task_id, f"request-{i}", accepted=True)
    await asyncio.sleep(0.01)
    assert _bits(holder) == bits and holder.count == len(listed)
    _check(params, holder, [_row(i) for i in listed], [_weight(i) for i in listed])
