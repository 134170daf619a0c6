"""Contract: results are stored once per assignment, retries get the original outcome, late ones are stale."""

from __future__ import annotations

from datetime import timedelta

import pytest

from fedlink.common.errors import Conflict, NotFound, PermissionDenied
from fedlink.server.domain import Assignment, AssignmentState, ReportOutcome, ResultStatus
from fedlink.server.store import ResultReport
from fedlink.server.store.testing import World

LEASE = timedelta(seconds=30)
SHA_A = "a" * 64
SHA_B = "b" * 64


def report(
    held: Assignment,
    *,
    request_id: str = "req-1",
    digest: str = "digest-1",
    status: ResultStatus = ResultStatus.SUCCEEDED,
    payload: str | None = SHA_A,
    device_id: str | None = None,
) -> ResultReport:
    return ResultReport(
        assignment_id=held.assignment_id,
        device_id=device_id or held.device_id,
        status=status,
        payload_sha256=payload,
        report_digest=digest,
        request_id=request_id,
        error_message="" if status is ResultStatus.SUCCEEDED else "executor failed",
    )


async def claim(world: World, device_index: int = 0) -> Assignment:
    held = await world.store.claim_task(
        world.devices[device_index].device_id, world.job.job_id, world.clock.now(), LEASE
    )
    assert held is not None
    return held


async def test_success_completes_the_assignment(world: World) -> None:
    (task,) = await world.tasks(1, slots=2)
    held = await claim(world)
    outcome = await world.store.record_result(report(held), world.clock.now())
    assert outcome.outcome is ReportOutcome.ACCEPTED and not outcome.duplicate
    assert outcome.result.accepted and not outcome.result.stale
    assert outcome.result.payload_sha256 == SHA_A
    assert (await world.store.get_assignment(held.assignment_id)).state is AssignmentState.COMPLETED
    assert [r.result_id for r in await world.store.list_results(task_id=task.task_id)] == [
        outcome.result.result_id
    ]


async def test_same_report_twice_is_stored_once(world: World) -> None:
    (task,) = await world.tasks(1)
    held = await claim(world)
    first = await world.store.record_result(report(held), world.clock.now())
    by_request = await world.store.record_result(report(held, digest="other"), world.clock.now())
    by_digest = await world.store.record_result(report(held, request_id="req-2"), world.clock.now())
    for again in (by_request, by_digest):
        assert again.duplicate and again.outcome is first.outcome
        assert again.result == first.result
    assert len(await world.store.list_results(task_id=task.task_id, accepted_only=False)) == 1


async def test_different_second_report_conflicts(world: World) -> None:
    await world.tasks(1)
    held = await claim(world)
    await world.store.record_result(report(held), world.clock.now())
    with pytest.raises(Conflict, match=held.assignment_id):
        await world.store.record_result(
            report(held, request_id="req-2", digest="digest-2", payload=SHA_B), world.clock.now()
        )


async def test_report_after_lease_expiry_is_stale_without_payload(world: World) -> None:
    (task,) = await world.tasks(1)
    held = await claim(world)
    now = world.clock.advance(LEASE)
    await world.store.expire_leases(now)
    outcome = await world.store.record_result(report(held), now)
    assert outcome.outcome is ReportOutcome.STALE
    assert outcome.result.stale and not outcome.result.accepted
    assert outcome.result.payload_sha256 is None
    assert outcome.result.request_id == "req-1"
    assert await world.store.list_results(task_id=task.task_id) == []
    assert len(await world.store.list_results(task_id=task.task_id, accepted_only=False)) == 1
    # A retry of the stale report gets STALE again, not OK.
    again = await world.store.record_result(report(held), now)
    assert again.duplicate and again.outcome is ReportOutcome.STALE


async def test_report_for_lapsed_lease_is_stale_even_before_the_reaper(world: World) -> None:
    await world.tasks(1)
    held = await claim(world)
    now = world.clock.advance(LEASE + timedelta(seconds=1))
    outcome = await world.store.record_result(report(held), now)
    assert outcome.outcome is ReportOutcome.STALE
    assert (await world.store.get_assignment(held.assignment_id)).state is AssignmentState.EXPIRED


async def test_report_for_closed_task_is_stale(world: World) -> None:
    (task,) = await world.tasks(1, slots=2)
    held = await claim(world)
    await world.store.close_task(task.task_id)
    outcome = await world.store.record_result(report(held), world.clock.now())
    assert outcome.outcome is ReportOutcome.STALE and outcome.result.payload_sha256 is None


async def test_failure_frees_the_slot(world: World) -> None:
    (task,) = await world.tasks(1, slots=1)
    held = await claim(world)
    outcome = await world.store.record_result(
        report(held, status=ResultStatus.FAILED, payload=None), world.clock.now()
    )
    assert outcome.outcome is ReportOutcome.ACCEPTED
    assert not outcome.result.accepted and outcome.result.error_message == "executor failed"
    assert (await world.store.get_assignment(held.assignment_id)).state is AssignmentState.FAILED
    other = await claim(world, 1)
    assert (other.task_id, other.slot) == (task.task_id, 0)


async def test_report_by_another_device_or_for_nothing(world: World) -> None:
    await world.tasks(1)
    held = await claim(world)
    with pytest.raises(PermissionDenied):
        await world.store.record_result(report(held, device_id=world.devices[1].device_id), world.clock.now())
    ghost = report(held)
    ghost = ResultReport(**{**{f: getattr(ghost, f) for f in ghost.__slots__}, "assignment_id": "f" * 32})
    with pytest.raises(NotFound):
        await world.store.record_result(ghost, world.clock.now())


async def test_batch_reports_errors_per_item(world: World) -> None:
    await world.tasks(1, slots=2)
    first, second = await claim(world, 0), await claim(world, 1)
    outcomes = await world.store.record_results(
        [report(first), report(second, device_id=world.devices[0].device_id), report(first)],
        world.clock.now(),
    )
    assert not isinstance(outcomes[0], Exception) and outcomes[0].outcome is ReportOutcome.ACCEPTED
    assert isinstance(outcomes[1], PermissionDenied)
    assert not isinstance(outcomes[2], Exception) and outcomes[2].duplicate
    # The refused report changed nothing: its device can still report.
    assert (
        await world.store.record_result(report(second), world.clock.now())
    ).outcome is ReportOutcome.ACCEPTED


async def test_results_of_a_round_come_in_device_order(world: World) -> None:
    await world.tasks(1, slots=3, round=3)
    await world.tasks(1, slots=2, round=4)
    assignments = [await claim(world, i) for i in (5, 2, 7, 0, 3)]
    for held in assignments:
        await world.store.record_result(report(held, request_id=held.assignment_id), world.clock.now())
    in_round = await world.store.list_results(run_id=world.run.run_id, round=3)
    assert [r.device_id for r in in_round] == sorted(a.device_id for a in assignments[:3])
    assert len(await world.store.list_results(run_id=world.run.run_id)) == 5


async def test_result_outlines_say_who_reported_what_in_which_round(world: World) -> None:
    await world.tasks(1, slots=2, round=1)
    await world.tasks(1, slots=1, round=2)
    ok, failed, late = await claim(world, 0), await claim(world, 1), await claim(world, 2)
    await world.store.record_result(report(ok), world.clock.now())
    await world.store.record_result(
        report(failed, status=ResultStatus.FAILED, payload=None), world.clock.now()
    )
    world.clock.advance(LEASE * 2)  # the round-2 report comes after its lease ran out: stale
    await world.store.record_result(report(late), world.clock.now())
    outlines = sorted(await world.store.result_outlines(world.run.run_id), key=lambda o: o.round)
    seen = [(o.round, o.task_name, o.device_id, o.status, o.accepted, o.error_message) for o in outlines]
    ids = [d.device_id for d in world.devices]
    round_one = sorted(seen[:2], key=lambda s: ids.index(s[2]))
    assert round_one == [
        (1, "train", ids[0], ResultStatus.SUCCEEDED, True, ""),
        (1, "train", ids[1], ResultStatus.FAILED, False, "executor failed"),
    ]
    assert seen[2] == (2, "train", ids[2], ResultStatus.SUCCEEDED, False, "")
    assert await world.store.result_outlines("0" * 32) == []
