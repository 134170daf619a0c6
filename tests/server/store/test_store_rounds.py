"""Contract: the round read-side (summary, targets, assignments, blob access), bulk close, claimable
pre-check, and batched blob writes."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest

from fedlink.common.errors import NotFound
from fedlink.server.domain import ReportOutcome, ResultStatus, TaskState
from fedlink.server.store import ResultReport
from fedlink.server.store.testing import World

LEASE = timedelta(seconds=30)


def _report(world: World, assignment_id: str, device_id: str, status: ResultStatus, tag: str) -> ResultReport:
    return ResultReport(
        assignment_id=assignment_id,
        device_id=device_id,
        status=status,
        payload_sha256=None,
        report_digest=hashlib.sha256(tag.encode()).hexdigest(),
        request_id=tag,
        error_message="" if status is ResultStatus.SUCCEEDED else "boom",
    )


async def test_round_summary_counts_what_each_device_did(world: World) -> None:
    store, job_id, run_id = world.store, world.job.job_id, world.run.run_id
    devices = [d.device_id for d in world.devices[:5]]
    tasks = [(await world.tasks(1, targets=[d]))[0] for d in devices]
    now = world.clock.now()
    summary = await store.round_summary(run_id=run_id, round=1, name="train")
    assert (summary.tasks, summary.first_wave, summary.open, summary.owing, summary.lost_open) == (
        5,
        1,
        5,
        5,
        0,
    )
    assert summary.next_deadline == min(t.deadline for t in tasks)
    assert summary.oldest_unclaimed == min(t.created_at for t in tasks)

    claimed = {d: await store.claim_task(d, job_id, now, LEASE) for d in devices[:4]}
    a0, a1, a2, a3 = (claimed[d] for d in devices[:4])
    assert a0 and a1 and a2 and a3
    ok = await store.record_result(
        _report(world, a0.assignment_id, devices[0], ResultStatus.SUCCEEDED, "r0"), now
    )
    assert ok.outcome is ReportOutcome.ACCEPTED
    await store.record_result(_report(world, a1.assignment_id, devices[1], ResultStatus.FAILED, "r1"), now)
    await store.release_assignment(a2.assignment_id, devices[2], now)
    # devices[3] holds its lease; devices[4] has not claimed yet: both still owe a result.
    summary = await store.round_summary(run_id=run_id, round=1, name="train")
    assert summary.succeeded == 1
    assert summary.lost_open == 2  # the failed one and the released one
    assert summary.owing == 2
    # Only devices[4]'s task was never claimed (a released or failed one was: it is lost instead).
    assert summary.oldest_unclaimed == tasks[4].created_at
    assert await store.round_summary(run_id=run_id, round=2, name="train") == type(summary)(
        tasks=0, first_wave=0, open=0, succeeded=0, owing=0, lost_open=0, next_deadline=None
    )

    assert await store.close_round_tasks(run_id=run_id, round=1, name="train") == 5
    assert {t.state for t in await store.list_tasks(run_id, round=1)} == {TaskState.CLOSED}
    assert await store.close_round_tasks(run_id=run_id, round=1, name="train") == 0
    summary = await store.round_summary(run_id=run_id, round=1, name="train")
    assert (summary.open, summary.owing, summary.lost_open, summary.succeeded) == (0, 0, 0, 1)
    assert summary.oldest_unclaimed is None  # closed tasks wait for no one


async def test_targets_assignments_and_blob_access(world: World) -> None:
    store, job_id = world.store, world.job.job_id
    ref = await store.blobs.put_bytes(b"global model")
    d0, d1 = world.devices[0].device_id, world.devices[1].device_id
    (t0,) = await world.tasks(1, targets=[d0], payload_sha256=ref.sha256)
    (t1,) = await world.tasks(1, targets=[d1, d0])
    (free,) = await world.tasks(1)
    targets = await store.task_targets(task_ids=[t0.task_id, t1.task_id, free.task_id])
    assert targets == {t0.task_id: (d0,), t1.task_id: tuple(sorted([d0, d1]))}
    assert not await store.device_may_read_blob(d0, ref.sha256)  # offered, not yet assigned
    assignment = await store.claim_task(d0, job_id, world.clock.now(), LEASE)
    assert assignment is not None and assignment.task_id == t0.task_id
    assert await store.device_may_read_blob(d0, ref.sha256)
    assert not await store.device_may_read_blob(d1, ref.sha256)
    assert [a.assignment_id for a in await store.list_assignments(task_ids=[t0.task_id, t1.task_id])] == [
        assignment.assignment_id
    ]


async def test_has_claimable_agrees_with_claims(world: World) -> None:
    store, job_id = world.store, world.job.job_id
    d0, d1, d2 = (d.device_id for d in world.devices[:3])
    now = world.clock.now()
    assert not await store.has_claimable(d0, job_id, now)
    await world.tasks(1, targets=[d0])
    assert await store.has_claimable(d0, job_id, now)
    assert not await store.has_claimable(d1, job_id, now)  # targeted at someone else
    (shared,) = await world.tasks(1, slots=1)
    assert await store.has_claimable(d1, job_id, now)
    held = await store.claim_task(d0, job_id, now, LEASE)
    assert held is not None
    assert await store.has_claimable(d0, job_id, now)  # re-delivery counts
    taken = await store.claim_task(d1, job_id, now, LEASE)
    assert taken is not None and taken.task_id == shared.task_id
    assert not await store.has_claimable(d2, job_id, now)  # the one slot is taken
    later = now + timedelta(minutes=20)
    assert not await store.has_claimable(d0, job_id, later)  # past every deadline


async def test_put_many_stores_each_content_once(world: World) -> None:
    blobs = world.store.blobs
    first = await blobs.put_bytes(b"already here")
    datas = [b"a" * 10, b"b" * 2_000_000, b"a" * 10, b"already here"]
    refs = await blobs.put_many(datas)
    assert [r.sha256 for r in refs] == [hashlib.sha256(d).hexdigest() for d in datas]
    assert refs[3].sha256 == first.sha256
    for ref, data in zip(refs, datas, strict=True):
        assert await blobs.read(ref.sha256) == data
        assert (await blobs.stat(ref.sha256)).size_bytes == len(data)
    assert await blobs.put_many([]) == []


async def test_round_retries_are_counted_per_round_and_task_name(world: World) -> None:
    run_id = world.run.run_id
    assert await world.store.round_retries(run_id=run_id, round=1, name="train") == 0
    assert await world.store.count_round_retry(run_id=run_id, round=1, name="train") == 1
    assert await world.store.count_round_retry(run_id=run_id, round=1, name="train") == 2
    assert await world.store.count_round_retry(run_id=run_id, round=2, name="train") == 1
    assert await world.store.round_retries(run_id=run_id, round=1, name="train") == 2
    assert await world.store.round_retries(run_id=run_id, round=1, name="evaluate") == 0
    with pytest.raises(NotFound, match="no-such-run"):
        await world.store.count_round_retry(run_id="no-such-run", round=1, name="train")


async def test_results_and_retries_share_their_rounds_count_row(world: World) -> None:
    # A retry taken first, then a result accepted: both counts kept (one row per round and name).
    run_id = world.run.run_id
    device = world.devices[0].device_id
    await world.store.count_round_retry(run_id=run_id, round=1, name="train")
    await world.tasks(1, targets=(device,))
    held = await world.store.claim_task(device, world.job.job_id, world.clock.now(), timedelta(seconds=30))
    assert held is not None
    report = ResultReport(
        assignment_id=held.assignment_id,
        device_id=device,
        status=ResultStatus.SUCCEEDED,
        payload_sha256=None,
        report_digest="d",
        request_id="r",
        error_message="",
    )
    await world.store.record_result(report, world.clock.now())
    assert await world.store.count_round_retry(run_id=run_id, round=1, name="train") == 2
    (event,) = [e for e in await world.store.list_job_events(world.job.job_id) if e.kind == "result_received"]
    assert '"num_results": 1' in event.payload_json
