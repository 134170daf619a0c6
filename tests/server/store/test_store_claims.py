"""Contract: claims, re-delivery, targets, leases and their expiry, and no double claims under concurrency."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from datetime import timedelta, timezone
from pathlib import Path

import pytest

from bench.orphans import tied
from fedlink.common.errors import IllegalTransition, PermissionDenied
from fedlink.server.domain import AssignmentState, LeaseLost, TaskState
from fedlink.server.store import ClaimRequest, NewTask, SqlStateStore
from fedlink.server.store.testing import StoreFactory, World

LEASE = timedelta(seconds=30)


async def test_claim_takes_oldest_open_task_and_lowest_slot(world: World) -> None:
    first, second = await world.tasks(2, slots=2)
    now = world.clock.now()
    d0, d1, d2 = (d.device_id for d in world.devices[:3])
    a0 = await world.store.claim_task(d0, world.job.job_id, now, LEASE)
    a1 = await world.store.claim_task(d1, world.job.job_id, now, LEASE)
    a2 = await world.store.claim_task(d2, world.job.job_id, now, LEASE)
    assert a0 is not None and a1 is not None and a2 is not None
    assert (a0.task_id, a0.slot) == (first.task_id, 0)
    assert (a1.task_id, a1.slot) == (first.task_id, 1)
    assert (a2.task_id, a2.slot) == (second.task_id, 0)
    assert a0.state is AssignmentState.LEASED
    assert a0.lease_expires_at == now + LEASE
    assert a0.job_id == world.job.job_id and a0.device_id == d0


async def test_unexpired_assignment_is_redelivered(world: World) -> None:
    await world.tasks(3)
    device = world.devices[0].device_id
    first = await world.store.claim_task(device, world.job.job_id, world.clock.now(), LEASE)
    world.clock.advance(timedelta(seconds=10))
    again = await world.store.claim_task(device, world.job.job_id, world.clock.now(), LEASE)
    assert again == first


async def test_nothing_to_claim_returns_none(world: World) -> None:
    (task,) = await world.tasks(1, slots=1)
    store, job_id = world.store, world.job.job_id
    now = world.clock.now()
    assert await store.claim_task(world.devices[0].device_id, job_id, now, LEASE) is not None
    # Full task, closed task, passed deadline, other job: nothing for the others.
    assert await store.claim_task(world.devices[1].device_id, job_id, now, LEASE) is None
    (late,) = await world.tasks(1, deadline=timedelta(seconds=1))
    assert (
        await store.claim_task(world.devices[1].device_id, job_id, now + timedelta(seconds=2), LEASE) is None
    )
    await store.close_task(late.task_id)
    assert await store.claim_task(world.devices[1].device_id, job_id, now, LEASE) is None
    assert await store.claim_task(world.devices[1].device_id, "0" * 32, now, LEASE) is None
    with pytest.raises(IllegalTransition):
        await store.close_task(late.task_id)
    assert (await store.get_task(task.task_id)).state is TaskState.OPEN


async def test_device_never_gets_the_same_task_twice(world: World) -> None:
    (task,) = await world.tasks(1, slots=3)
    device = world.devices[0].device_id
    first = await world.store.claim_task(device, world.job.job_id, world.clock.now(), LEASE)
    assert first is not None
    await world.store.release_assignment(first.assignment_id, device, world.clock.now())
    # The slot is free again, but this device had its chance at this task.
    assert await world.store.claim_task(device, world.job.job_id, world.clock.now(), LEASE) is None
    other = await world.store.claim_task(
        world.devices[1].device_id, world.job.job_id, world.clock.now(), LEASE
    )
    assert other is not None and other.task_id == task.task_id and other.slot == 0


async def test_targeted_task_goes_only_to_its_targets(world: World) -> None:
    target = world.devices[3].device_id
    (task,) = await world.tasks(1, slots=2, targets=[target])
    now = world.clock.now()
    assert await world.store.claim_task(world.devices[0].device_id, world.job.job_id, now, LEASE) is None
    claimed = await world.store.claim_task(target, world.job.job_id, now, LEASE)
    assert claimed is not None and claimed.task_id == task.task_id
    assert (await world.store.get_task(task.task_id)).targeted


async def test_expired_lease_frees_the_slot_for_another_device(world: World) -> None:
    (task,) = await world.tasks(1, slots=1)
    store, job_id = world.store, world.job.job_id
    holder, waiter = world.devices[0].device_id, world.devices[1].device_id
    held = await store.claim_task(holder, job_id, world.clock.now(), LEASE)
    assert held is not None
    assert await store.claim_task(waiter, job_id, world.clock.now(), LEASE) is None
    assert await store.expire_leases(world.clock.now()) == []

    now = world.clock.advance(LEASE)
    expired = await store.expire_leases(now)
    assert [a.assignment_id for a in expired] == [held.assignment_id]
    assert expired[0].state is AssignmentState.EXPIRED
    taken = await store.claim_task(waiter, job_id, now, LEASE)
    assert taken is not None and (taken.task_id, taken.slot) == (task.task_id, 0)
    # The old holder lost it for good.
    with pytest.raises(LeaseLost):
        await store.renew_lease(held.assignment_id, holder, now, LEASE)
    assert await store.claim_task(holder, job_id, now, LEASE) is None


async def test_lapsed_lease_is_not_redelivered_even_before_the_reaper(world: World) -> None:
    await world.tasks(1, slots=1)
    device = world.devices[0].device_id
    held = await world.store.claim_task(device, world.job.job_id, world.clock.now(), LEASE)
    assert held is not None
    later = world.clock.advance(LEASE + timedelta(seconds=1))
    assert await world.store.claim_task(device, world.job.job_id, later, LEASE) is None


async def test_renew_and_release(world: World) -> None:
    await world.tasks(1, slots=1)
    store, device = world.store, world.devices[0].device_id
    held = await store.claim_task(device, world.job.job_id, world.clock.now(), LEASE)
    assert held is not None
    now = world.clock.advance(timedelta(seconds=20))
    renewed = await store.renew_lease(held.assignment_id, device, now, LEASE)
    assert renewed.lease_expires_at == now + LEASE
    with pytest.raises(PermissionDenied):
        await store.renew_lease(held.assignment_id, world.devices[1].device_id, now, LEASE)
    # Past the first lease but within the renewed one: still held.
    now = world.clock.advance(timedelta(seconds=20))
    assert await store.expire_leases(now) == []
    released = await store.release_assignment(held.assignment_id, device, now)
    assert released.state is AssignmentState.RELEASED
    with pytest.raises(LeaseLost, match="RELEASED"):
        await store.release_assignment(held.assignment_id, device, now)
    other = await store.claim_task(world.devices[1].device_id, world.job.job_id, now, LEASE)
    assert other is not None and other.slot == 0


async def test_cancelled_tasks_are_not_claimed(world: World) -> None:
    await world.tasks(3)
    assert await world.store.cancel_job_tasks(world.job.job_id) == 3
    assert (
        await world.store.claim_task(world.devices[0].device_id, world.job.job_id, world.clock.now(), LEASE)
        is None
    )


async def test_batched_claims_in_one_call(world: World) -> None:
    (task,) = await world.tasks(1, slots=3)
    requests = [ClaimRequest(device_id=d.device_id, job_id=world.job.job_id) for d in world.devices[:5]]
    requests.append(requests[0])  # the same device twice in one batch gets its one assignment twice
    claimed = await world.store.claim_tasks(requests, world.clock.now(), LEASE)
    assert [c is not None for c in claimed] == [True, True, True, False, False, True]
    assert claimed[0] == claimed[5]
    assert sorted(c.slot for c in claimed[:3] if c is not None) == [0, 1, 2]
    assert {c.task_id for c in claimed if c is not None} == {task.task_id}


def _check_no_double_claims(claims: list[tuple[str, str, int]], slots: dict[str, int]) -> None:
    per_task = Counter(task_id for task_id, _, _ in claims)
    for task_id, count in per_task.items():
        assert count <= slots[task_id], f"task {task_id} has {count} holders for {slots[task_id]} slots"
    pairs = Counter((task_id, device) for task_id, device, _ in claims)
    assert max(pairs.values()) == 1, "a device got the same task twice"
    slot_use = Counter((task_id, slot) for task_id, _, slot in claims)
    assert max(slot_use.values()) == 1, "two devices hold the same slot"


async def test_no_double_claims_under_concurrency(world: World, more_stores: StoreFactory) -> None:
    """Eight stores (own engines) claim concurrently for 32 devices, round after round."""
    store = world.store
    devices = [f"dev-{i:02d}" for i in range(32)]
    stores: list[SqlStateStore] = [await more_stores() for _ in range(8)]
    claims: list[tuple[str, str, int]] = []
    slots: dict[str, int] = {}
    for round in range(1, 5):
        tasks = await world.tasks(3, slots=2, round=round)
        slots.update({t.task_id: t.slots for t in tasks})
        now = world.clock.now()

        async def worker(index: int, now: object = now) -> list[tuple[str, str, int]]:
            mine = devices[index::8]
            got = []
            for device in mine:
                claimed = await stores[index].claim_task(device, world.job.job_id, now, LEASE)  # type: ignore[arg-type]
                if claimed is not None:
                    got.append((claimed.task_id, claimed.device_id, claimed.slot))
            return got

        results = await asyncio.gather(*(worker(i) for i in range(8)))
        round_claims = [c for r in results for c in r]
        assert len(round_claims) == 6, "every slot of the round should be taken once"
        claims.extend(round_claims)
        await store.cancel_job_tasks(world.job.job_id)
    _check_no_double_claims(claims, slots)


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_no_double_claims_across_processes(world: World, store_url: str, tmp_path: Path) -> None:
    """Two OS processes, four connections each, race for the same few slots on PostgreSQL."""
    tasks = await world.tasks(6, slots=3)
    worker = Path(__file__).with_name("claim_worker.py")
    procs = [
        await asyncio.create_subprocess_exec(
            *tied([sys.executable]),
            str(worker),
            store_url,
            world.job.job_id,
            f"proc{p}",
            world.clock.now().isoformat(),
            stdout=asyncio.subprocess.PIPE,
        )
        for p in range(2)
    ]
    outputs = await asyncio.gather(*(p.communicate() for p in procs))
    assert all(p.returncode == 0 for p in procs)
    claims = []
    for stdout, _ in outputs:
        for line in stdout.decode().splitlines():
            task_id, device, slot = line.split()
            claims.append((task_id, device, int(slot)))
    assert len(claims) == 18, "every slot should be taken exactly once"
    _check_no_double_claims(claims, {t.task_id: t.slots for t in tasks})


async def test_created_tasks_are_what_the_store_reads_back(world: World) -> None:
    ids = [d.device_id for d in world.devices]
    # A deadline in another time zone, and targeted and untargeted tasks, in one call.
    other_zone = timezone(timedelta(hours=5, minutes=30))
    deadline = (world.clock.now() + timedelta(minutes=3, microseconds=7)).astimezone(other_zone)
    news = [
        NewTask(
            job_id=world.job.job_id,
            run_id=world.run.run_id,
            round=3,
            name=name,
            payload_sha256=sha,
            deadline=deadline,
            slots=slots,
            targets=targets,
        )
        for name, sha, slots, targets in (
            ("train", "a" * 64, 1, (ids[0],)),
            ("evaluate", None, 2, ()),
            ("train", None, 3, tuple(ids[1:4])),
        )
    ]
    made = await world.store.create_tasks(news)
    assert list(made) == [await world.store.get_task(t.task_id) for t in made]
    listed = await world.store.list_tasks(world.run.run_id, round=3)  # same created_at: by task_id
    assert sorted(made, key=lambda t: t.task_id) == list(listed)
