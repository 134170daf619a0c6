"""Contract: which assignments are open (a report would count) agrees with how a report is judged."""

from __future__ import annotations

from datetime import timedelta

from fedlink.server.domain import Assignment, ReportOutcome, ResultStatus
from fedlink.server.store import ResultReport
from fedlink.server.store.testing import World

LEASE = timedelta(seconds=30)


async def claim(world: World, device_index: int) -> Assignment:
    held = await world.store.claim_task(
        world.devices[device_index].device_id, world.job.job_id, world.clock.now(), LEASE
    )
    assert held is not None
    return held


def report(held: Assignment, request_id: str) -> ResultReport:
    return ResultReport(
        assignment_id=held.assignment_id,
        device_id=held.device_id,
        status=ResultStatus.SUCCEEDED,
        payload_sha256="a" * 64,
        report_digest=request_id,
        request_id=request_id,
        error_message="",
    )


async def is_open(world: World, held: Assignment) -> bool:
    return held.assignment_id in await world.store.open_assignments([held.assignment_id], world.clock.now())


async def test_a_leased_assignment_is_open_until_it_has_a_result(world: World) -> None:
    await world.tasks(1, slots=3)
    first, second = await claim(world, 0), await claim(world, 1)
    now = world.clock.now()
    ids = [first.assignment_id, second.assignment_id, first.assignment_id, "f" * 32]
    assert await world.store.open_assignments(ids, now) == {first.assignment_id, second.assignment_id}
    assert await world.store.open_assignments([], now) == set()
    outcome = await world.store.record_result(report(first, "r1"), now)
    assert outcome.outcome is ReportOutcome.ACCEPTED
    assert await world.store.open_assignments(ids, now) == {second.assignment_id}


async def test_an_ended_lease_or_a_released_assignment_is_not_open(world: World) -> None:
    await world.tasks(1, slots=3)
    expiring, released = await claim(world, 0), await claim(world, 1)
    await world.store.release_assignment(released.assignment_id, released.device_id, world.clock.now())
    assert not await is_open(world, released)
    assert await is_open(world, expiring)
    world.clock.advance(LEASE)  # the lease ends now; the reaper has not run
    assert not await is_open(world, expiring)
    outcome = await world.store.record_result(report(expiring, "late"), world.clock.now())
    assert outcome.outcome is ReportOutcome.STALE


async def test_a_closed_task_or_a_passed_deadline_is_not_open(world: World) -> None:
    closing, due = await world.tasks(2, deadline=timedelta(seconds=10))
    held_closing, held_due = await claim(world, 0), await claim(world, 1)
    assert {held_closing.task_id, held_due.task_id} == {closing.task_id, due.task_id}
    await world.store.close_task(held_closing.task_id)
    assert not await is_open(world, held_closing)
    assert await is_open(world, held_due)
    world.clock.advance(timedelta(seconds=10))  # within the lease, at the task's deadline
    assert not await is_open(world, held_due)
    for held in (held_closing, held_due):
        outcome = await world.store.record_result(report(held, held.assignment_id), world.clock.now())
        assert outcome.outcome is ReportOutcome.STALE
