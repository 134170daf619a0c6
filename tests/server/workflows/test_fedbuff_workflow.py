"""FedBuff's rules, each with a test that fails if it breaks: the selection and its refills, versions
after K updates, staleness, the history limit, the end, the device wait, and resuming after a restart.

The devices are played through the store (see ``fedbuff_world``); the workflow runs as the coordinator
runs it, against SQLite.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from fedlink.common.dxo import DXO, DataKind
from fedlink.common.errors import FailedPrecondition, InvalidArgument
from fedlink.server.domain import (
    EVALUATE_TASK,
    TRAIN_TASK,
    ManualClock,
    ReportOutcome,
    Task,
    TaskState,
)
from fedlink.server.store import SqlStateStore, create_store
from fedlink.server.workflows.fedbuff import FedBuffParams

from .fedbuff_world import MODEL, T0, FedBuffWorld, expected_model


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
async def store(tmp_path: Path, clock: ManualClock) -> AsyncIterator[SqlStateStore]:
    s = await create_store(
        f"sqlite+aiosqlite:///{tmp_path / 'fedbuff.db'}",
        blob_dir=tmp_path / "blobs",
        clock=clock,
        auto_migrate=True,
    )
    yield s
    await s.close()


def _params(**overrides: object) -> FedBuffParams:
    base: dict[str, object] = {
        "max_model_version": 100,
        "num_updates_for_model": 1000,
        "device_selection_size": 4,
        "max_model_history": 0,
        "pickup_timeout_s": 30.0,
        "task_timeout_s": 600.0,
    }
    base.update(overrides)
    return FedBuffParams(**base)  # type: ignore[arg-type]


async def _world(
    store: SqlStateStore, clock: ManualClock, *, devices: int = 10, **params: object
) -> FedBuffWorld:
    world = await FedBuffWorld.open(store, clock, _params(**params), devices=devices)
    await world.start()
    return world


async def test_device_selection_size_devices_hold_a_task_at_once_on_the_current_version(
    store: SqlStateStore, clock: ManualClock
) -> None:
    world = await _world(store, clock, device_selection_size=4)
    out = await world.settled(4)
    assert len(set(out)) == 4  # four distinct devices
    assert {t.model_version for t in out.values()} == {0}
    assert {t.round for t in out.values()} == {0}
    await world.stop()


async def test_a_reported_slot_is_refilled_once_min_hole_to_fill_slots_are_free(
    store: SqlStateStore, clock: ManualClock
) -> None:
    world = await _world(store, clock, device_selection_size=4, min_hole_to_fill=2)
    out = await world.settled(4)
    first, second, *_ = sorted(out)
    await world.report(first)
    await world.until(lambda: _true_after(world), what="the driver to look")
    assert len(await world.out()) == 3  # one hole: not refilled yet
    await world.report(second)
    refilled = await world.settled(4)
    assert first not in refilled or refilled[first].task_id != out[first].task_id
    await world.stop()


async def _true_after(world: FedBuffWorld) -> bool:
    """True once the driver has had time to look (a few of its polls)."""
    await asyncio.sleep(0.1)
    return True


@pytest.mark.parametrize("loss", ["failure", "release", "expiry", "pickup"])
async def test_a_slot_freed_by_a_failure_release_expiry_or_missed_pickup_is_refilled(
    store: SqlStateStore, clock: ManualClock, loss: str
) -> None:
    world = await _world(store, clock, devices=6, device_selection_size=3)
    out = await world.settled(3)
    victim = sorted(out)[0]
    if loss == "failure":
        await world.report(victim, fail=True)
    elif loss == "release":
        await world.release(victim)
    elif loss == "expiry":
        await world.expire(victim)
    else:  # the device never claims: past the pickup timeout its slot goes to another device
        for device in sorted(out)[1:]:
            await world.claim(device)
        clock.advance(timedelta(seconds=31))
        world.progress.poke()

    async def replaced() -> bool:
        now_out = await world.out()
        return len(now_out) == 3 and out[victim].task_id not in {t.task_id for t in now_out.values()}

    await world.until(replaced, what="the lost slot refilled")
    victim_task = await store.get_task(out[victim].task_id)
    assert victim_task.state in (TaskState.OPEN, TaskState.CLOSED)
    if loss != "failure":  # a lost task is closed: a late report would be STALE
        assert victim_task.state is TaskState.CLOSED
    await world.stop()


async def test_without_device_reuse_no_device_gets_a_second_task(
    store: SqlStateStore, clock: ManualClock
) -> None:
    world = await _world(store, clock, devices=6, device_selection_size=2, device_reuse=False)
    seen: list[str] = []
    for _ in range(3):
        out = await world.settled(2)
        for device in sorted(out):
            if device not in seen:
                seen.append(device)
        for device in sorted(out):
            await world.report(device)
    assert len(seen) == 6 and len(set(seen)) == 6
    tasks = await store.list_tasks(world.run_id)
    targets = await store.task_targets(task_ids=[t.task_id for t in tasks])
    assert sorted(d for (d,) in targets.values()) == sorted(world.devices)
    await world.stop()


async def test_with_device_reuse_a_device_that_reported_may_train_again(
    store: SqlStateStore, clock: ManualClock
) -> None:
    world = await _world(store, clock, devices=2, device_selection_size=2)
    out = await world.settled(2)
    for device in sorted(out):
        await world.report(device)
    again = await world.settled(2)
    assert sorted(again) == sorted(out)
    await world.stop()


async def test_a_new_version_after_k_updates_across_versions_each_weighted_by_its_staleness(
    store: SqlStateStore, clock: ManualClock
) -> None:
    # selection 3, K = 2: versions mix updates trained on the current and the previous version
    world = await _world(
        store,
        clock,
        devices=3,
        device_selection_size=3,
        num_updates_for_model=2,
        staleness_weight=True,
        max_model_version=3,
    )
    a, b, c = world.devices
    await world.settled(3)
    await world.report(a)  # one update: a gets another task, still on version 0
    assert (await world.settled(3))[a].model_version == 0
    await world.report(b)  # version 1 from a and b (both on version 0, staleness 0)
    out = await world.settled(3)
    assert (out[a].model_version, out[b].model_version, out[c].model_version) == (0, 1, 0)
    await world.report(c)  # trained on 0, current 1: staleness 1
    await world.settled(3)
    await world.report(a)  # version 2 from c and a (both staleness 1)
    out = await world.settled(3)
    assert {d: t.model_version for d, t in out.items()} == {a: 2, b: 1, c: 1}
    await world.report(b)
    await world.settled(3)
    await world.report(c)  # version 3 from b and c (both on version 1, staleness 1)
    consumed = [[(0, 0, 0), (1, 0, 0)], [(2, 0, 1), (0, 0, 1)], [(1, 1, 2), (2, 1, 2)]]
    await world.driver  # type: ignore[misc]  # max_model_version 3: done
    run = await store.get_run(world.run_id)
    assert run.round == 3
    final = DXO.from_bytes(await store.blobs.read(run.global_model_sha256 or ""))
    want = expected_model(consumed, stale=True)
    for name in MODEL:
        np.testing.assert_array_max_ulp(final.data[name], want[name], maxulp=1)
    events = await world.events()
    assert [e["round"] for e in events] == [1, 2, 3]
    assert [e["staleness"] for e in events] == [{"0": 2}, {"1": 2}, {"1": 2}]
    assert [e["num_updates"] for e in events] == [2, 2, 2]
    # the tasks reported are closed with the versions they made: open tasks are the selection's
    tasks = await store.list_tasks(world.run_id)
    assert sorted(t.model_version or 0 for t in tasks if t.state is TaskState.OPEN) == [2, 2]
    assert sum(t.state is TaskState.CLOSED for t in tasks) == len(tasks) - 2


async def test_an_update_whose_staleness_reaches_max_model_history_is_stale_and_not_aggregated(
    store: SqlStateStore, clock: ManualClock
) -> None:
    world = await _world(
        store,
        clock,
        devices=3,
        device_selection_size=3,
        num_updates_for_model=1,
        max_model_history=2,
        max_model_version=3,
    )
    slow, fast, other = world.devices
    await world.settled(3)
    await world.claim(slow)  # trains on version 0 the whole time
    assert (await world.report(fast)).outcome is ReportOutcome.ACCEPTED  # version 1
    await world.settled(3)
    assert (await world.report(other)).outcome is ReportOutcome.ACCEPTED  # version 2 (staleness of 0: 2)
    await world.until(lambda: _version_is(world, 2), what="version 2")
    late = await world.report(slow)
    assert late.outcome is ReportOutcome.STALE
    assert not late.result.accepted
    # version 3 comes from the next accepted update, not from the stale one
    await world.settled(3)
    await world.report(fast)
    await world.driver  # type: ignore[misc]
    events = await world.events()
    assert all("2" not in e["staleness"] for e in events)
    assert events[-1]["counters"]["stale"] >= 1


async def _version_is(world: FedBuffWorld, version: int) -> bool:
    return await world.version() == version


async def test_an_update_accepted_before_its_version_fell_out_of_the_history_still_counts(
    store: SqlStateStore, clock: ManualClock
) -> None:
    world = await _world(
        store,
        clock,
        devices=3,
        device_selection_size=3,
        num_updates_for_model=2,
        max_model_history=1,
        max_model_version=1,
    )
    a, b, c = world.devices
    await world.settled(3)
    await world.stop()  # reports come in while nobody takes them: all accepted by the store
    for device in (a, b, c):
        assert (await world.report(device)).outcome is ReportOutcome.ACCEPTED
    await world.start()
    await world.driver  # type: ignore[misc]
    events = await world.events()
    assert events[0]["num_updates"] == 3  # the third was acknowledged OK: it is not dropped


async def test_the_job_ends_at_max_model_version(store: SqlStateStore, clock: ManualClock) -> None:
    world = await _world(
        store, clock, devices=2, device_selection_size=2, num_updates_for_model=1, max_model_version=2
    )
    for _ in range(2):
        out = await world.settled(2)
        await world.report(sorted(out)[0])
    await world.driver  # type: ignore[misc]
    assert await world.version() == 2
    checkpoints = await store.list_checkpoints(world.run_id)
    assert [c.round for c in checkpoints] == [1, 2]


async def test_the_job_fails_after_device_wait_timeout_without_enough_devices(
    store: SqlStateStore, clock: ManualClock
) -> None:
    world = await _world(store, clock, devices=3, device_selection_size=5, device_wait_timeout_s=60.0)
    await _true_after(world)
    assert await world.out() == {}  # the first fill waits for a whole selection
    clock.advance(timedelta(seconds=61))
    world.progress.poke()
    with pytest.raises(FailedPrecondition, match="device_wait_timeout"):
        await world.driver  # type: ignore[misc]


async def test_without_device_wait_timeout_the_job_waits_for_devices(
    store: SqlStateStore, clock: ManualClock
) -> None:
    world = await _world(store, clock, devices=3, device_selection_size=5)
    clock.advance(timedelta(hours=10))
    world.progress.poke()
    await _true_after(world)
    assert world.driver is not None and not world.driver.done()
    for i in range(3, 5):
        device = await store.enroll_device({"n": str(i)}, {}, f"cred-{i}", device_id=f"device-{i:03d}")
        await store.record_polls([(device.device_id, "")], clock.now())
    await world.settled(5)
    await world.stop()


async def test_a_refill_that_cannot_fill_the_selection_starts_the_device_wait(
    store: SqlStateStore, clock: ManualClock
) -> None:
    world = await _world(
        store, clock, devices=3, device_selection_size=3, device_reuse=False, device_wait_timeout_s=60.0
    )
    out = await world.settled(3)
    await world.report(sorted(out)[0])  # its slot cannot be refilled: no unused device
    await _true_after(world)
    clock.advance(timedelta(seconds=61))
    world.progress.poke()
    with pytest.raises(FailedPrecondition, match="device_wait_timeout"):
        await world.driver  # type: ignore[misc]


@pytest.mark.parametrize("via_sink", [False, True], ids=["from_the_store", "handed_over"])
async def test_weights_and_weight_diff_updates_make_the_same_model(
    store: SqlStateStore, clock: ManualClock, via_sink: bool
) -> None:
    world = await _world(
        store, clock, devices=4, device_selection_size=4, num_updates_for_model=4, max_model_version=1
    )
    out = await world.settled(4)
    for i, device in enumerate(sorted(out)):
        await world.report(
            device, via_sink=via_sink, kind=DataKind.WEIGHTS if i % 2 else DataKind.WEIGHT_DIFF
        )
    await world.driver  # type: ignore[misc]
    run = await store.get_run(world.run_id)
    final = DXO.from_bytes(await store.blobs.read(run.global_model_sha256 or ""))
    want = expected_model([[(i, 0, 0) for i in range(4)]])
    for name in MODEL:
        np.testing.assert_array_max_ulp(final.data[name], want[name], maxulp=1)


# ---- durability -----------------------------------------------------------------------------------


async def _scripted(world: FedBuffWorld, *, stop_after: int | None) -> bytes:
    """Versions 1-4 of a selection of 3 with K = 2, every report acknowledged, each waited for until
    the driver refilled the selection; with ``stop_after`` the driver is stopped right after that
    report (before it may have taken it) and a new one resumes the run. Returns the final model."""
    order = [0, 1, 2, 0, 1, 2, 0, 1]  # device indexes, in the order they report
    for n, index in enumerate(order, start=1):
        await world.settled(3)
        outcome = await world.report(world.devices[index], via_sink=n % 2 == 1)
        assert outcome.outcome is ReportOutcome.ACCEPTED
        if n == stop_after:
            await world.stop()
            await world.start()
    await world.driver  # type: ignore[misc]
    run = await world.store.get_run(world.run_id)
    assert run.round == 4
    events = await world.events()
    assert sum(e["num_updates"] for e in events) == 8  # every acknowledged update, once
    return await world.store.blobs.read(run.global_model_sha256 or "")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where the store of a durability test is: a SQLite file, or a throwaway PostgreSQL database."""
    if request.param == "postgres":
        return str(request.getfixturevalue("pg_database"))
    return f"sqlite+aiosqlite:///{tmp_path / 'durable.db'}"


@pytest.mark.parametrize("stop_after", [1, 2, 3, 6])
async def test_a_restarted_driver_resumes_without_losing_or_double_counting_an_update(
    tmp_path: Path, stop_after: int, store_url: str
) -> None:
    params = _params(
        device_selection_size=3, num_updates_for_model=2, max_model_version=4, max_model_history=3
    )
    finals = []
    # The run that is not interrupted is on SQLite; the restarted one on either store: the same bits.
    for name, stop in (("uninterrupted", None), ("restarted", stop_after)):
        clock = ManualClock(T0)
        url = store_url if stop else f"sqlite+aiosqlite:///{tmp_path / 'one.db'}"
        store = await create_store(url, blob_dir=tmp_path / name, clock=clock, auto_migrate=True)
        try:
            world = await FedBuffWorld.open(store, clock, params, devices=3)
            await world.start()
            finals.append(await _scripted(world, stop_after=stop))
        finally:
            await store.close()
    uninterrupted, restarted = (DXO.from_bytes(b) for b in finals)
    for name in MODEL:  # the same model, to the bit
        assert restarted.data[name].tobytes() == uninterrupted.data[name].tobytes(), name


async def test_updates_acknowledged_while_no_driver_runs_count_once_after_it_resumes(
    tmp_path: Path, store_url: str
) -> None:
    clock = ManualClock(T0)
    store = await create_store(
        store_url,
        blob_dir=tmp_path / "blobs",
        clock=clock,
        auto_migrate=True,
    )
    try:
        await _acknowledged_while_stopped(store, clock)
    finally:
        await store.close()


async def _acknowledged_while_stopped(store: SqlStateStore, clock: ManualClock) -> None:
    world = await _world(
        store, clock, devices=3, device_selection_size=3, num_updates_for_model=3, max_model_version=2
    )
    a, b, c = world.devices
    await world.settled(3)
    await world.report(a, via_sink=True)  # handed over, perhaps not taken yet when the driver dies
    await world.stop()
    await world.report(b)
    await world.report(c)
    await world.start()  # version 1 from a, b and c
    await world.settled(3)
    for device in (a, b, c):
        await world.report(device)
    await world.driver  # type: ignore[misc]
    run = await store.get_run(world.run_id)
    final = DXO.from_bytes(await store.blobs.read(run.global_model_sha256 or ""))
    want = expected_model([[(0, 0, 0), (1, 0, 0), (2, 0, 0)], [(0, 1, 1), (1, 1, 1), (2, 1, 1)]])
    for name in MODEL:
        np.testing.assert_array_max_ulp(final.data[name], want[name], maxulp=1)
    assert [e["num_updates"] for e in await world.events()] == [3, 3]


def test_params_refuse_what_has_no_meaning() -> None:
    with pytest.raises(InvalidArgument, match="min_hole_to_fill cannot exceed"):
        _params(device_selection_size=2, min_hole_to_fill=3)
    with pytest.raises(InvalidArgument, match="global_lr"):
        _params(global_lr=0.0)
    with pytest.raises(InvalidArgument, match="num_updates_for_model"):
        _params(num_updates_for_model=0)
    assert dataclasses.replace(_params(), max_model_history=0).live_versions() == 101


async def test_a_version_evaluated_across_a_restart_has_its_event_recorded_once(
    store: SqlStateStore, clock: ManualClock
) -> None:
    # A version's model_version event waits for its evaluation; the driver is killed while that is out.
    # The event is written with the checkpoint that releases it: after the restart, exactly once.
    world = await _world(
        store,
        clock,
        devices=3,
        device_selection_size=2,
        num_updates_for_model=2,
        max_model_version=2,
        eval_frequency=1,
        eval_devices=1,
    )

    async def until_out(name: str, count: int) -> dict[str, Task]:
        async def check() -> bool:
            return len(await world.out(name)) == count

        await world.until(check, what=f"{count} {name} tasks out")
        return await world.out(name)

    for version in (1, 2):
        for device in await until_out(TRAIN_TASK, 2):
            await world.report(device)
        (evaluator,) = await until_out(EVALUATE_TASK, 1)
        assert len(await world.events()) == version - 1  # held for its evaluation
        if version == 1:
            await world.stop()  # killed while the evaluation is out
            await world.start()
        await world.report(evaluator)  # offered its evaluate task first
        await world.until(functools.partial(_has_events, world, version), what=f"version {version}'s event")
    await world.driver  # type: ignore[misc]
    events = await world.events()
    assert [e["round"] for e in events] == [1, 2]  # each version's event once, in order
    assert all("eval_loss" in e["metrics"] for e in events)


async def _has_events(world: FedBuffWorld, count: int) -> bool:
    return len(await world.events()) >= count
