"""Contract: a task's offers (the claim path's view of its targets) leave when it closes, and freed slots
in the middle of a task are taken again, lowest first, by single and batched claims."""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa

from fedlink.server.domain import TaskState
from fedlink.server.store import ClaimRequest, SqlStateStore
from fedlink.server.store.schema import task_offers
from fedlink.server.store.testing import World

LEASE = timedelta(seconds=30)


async def offered(store: SqlStateStore) -> set[tuple[str, str]]:
    """Every (task, device) offer in the store."""
    async with store._db.read() as conn:
        found = await conn.execute(sa.select(task_offers.c.task_id, task_offers.c.device_id))
        return {(t, d) for t, d in found}


async def test_ending_a_task_withdraws_its_offers_and_keeps_its_targets(world: World) -> None:
    store, run_id = world.store, world.run.run_id
    d0, d1, d2 = (d.device_id for d in world.devices[:3])
    (round_task,) = await world.tasks(1, round=1, targets=[d0, d1])
    (closed,) = await world.tasks(1, round=2, targets=[d1])
    (cancelled,) = await world.tasks(1, round=3, targets=[d2])
    (untargeted,) = await world.tasks(1, round=3)
    assert await offered(store) == {
        (round_task.task_id, d0),
        (round_task.task_id, d1),
        (closed.task_id, d1),
        (cancelled.task_id, d2),
    }

    assert await store.close_round_tasks(run_id=run_id, round=1, name="train") == 1
    await store.close_task(closed.task_id)
    assert await offered(store) == {(cancelled.task_id, d2)}
    assert await store.cancel_job_tasks(world.job.job_id) == 2
    assert await offered(store) == set()

    states = {t.task_id: t.state for t in await store.list_tasks(run_id)}
    assert states == {
        round_task.task_id: TaskState.CLOSED,
        closed.task_id: TaskState.CLOSED,
        cancelled.task_id: TaskState.CANCELLED,
        untargeted.task_id: TaskState.CANCELLED,
    }
    targets = await store.task_targets(task_ids=[round_task.task_id, closed.task_id, cancelled.task_id])
    assert targets == {
        round_task.task_id: tuple(sorted([d0, d1])),
        closed.task_id: (d1,),
        cancelled.task_id: (d2,),
    }
    now = world.clock.now()
    assert await store.claim_tasks(
        [ClaimRequest(device_id=d, job_id=world.job.job_id) for d in (d0, d1, d2)], now, LEASE
    ) == [
        None,
        None,
        None,
    ]


async def test_freed_slots_are_taken_again_lowest_first(world: World) -> None:
    store, job_id = world.store, world.job.job_id
    devices = [d.device_id for d in world.devices[:7]]
    (task,) = await world.tasks(1, slots=4, targets=devices)
    now = world.clock.now()
    first = [await store.claim_task(d, job_id, now, LEASE) for d in devices[:4]]
    assert [a.slot for a in first if a is not None] == [0, 1, 2, 3]
    # Free slots 1 and 2; a single claim takes 1, then a batch of two takes 2 and finds nothing more.
    for held in first[1:3]:
        assert held is not None
        await store.release_assignment(held.assignment_id, held.device_id, now)
    single = await store.claim_task(devices[4], job_id, now, LEASE)
    assert single is not None and (single.task_id, single.slot) == (task.task_id, 1)
    batch = await store.claim_tasks(
        [ClaimRequest(device_id=d, job_id=job_id) for d in devices[5:7]], now, LEASE
    )
    assert [(a.task_id, a.slot) if a else None for a in batch].count((task.task_id, 2)) == 1
    assert batch.count(None) == 1
    # Slot 0 freed: the lowest again, for a batch claim.
    assert first[0] is not None
    await store.release_assignment(first[0].assignment_id, first[0].device_id, now)
    waiting = next(d for d, a in zip(devices[5:7], batch, strict=True) if a is None)
    (again,) = await store.claim_tasks([ClaimRequest(device_id=waiting, job_id=job_id)], now, LEASE)
    assert again is not None and again.slot == 0
