"""Contract: batches of claims and of reports, served set-based, mean what the same calls one by one mean."""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from datetime import timedelta

from fedlink.common.errors import Conflict, NotFound, PermissionDenied
from fedlink.server.domain import Assignment, AssignmentState, ReportOutcome, ResultStatus
from fedlink.server.store import ClaimRequest, ResultReport, SqlStateStore
from fedlink.server.store.testing import StoreFactory, World

LEASE = timedelta(seconds=30)
SHA = "c" * 64


def ask(world: World, *indexes: int) -> list[ClaimRequest]:
    return [ClaimRequest(device_id=world.devices[i].device_id, job_id=world.job.job_id) for i in indexes]


def report(held: Assignment, *, request_id: str | None = None, **changes: object) -> ResultReport:
    fields: dict[str, object] = {
        "assignment_id": held.assignment_id,
        "device_id": held.device_id,
        "status": ResultStatus.SUCCEEDED,
        "payload_sha256": SHA,
        "report_digest": f"digest-{held.assignment_id}",
        "request_id": request_id or f"req-{held.assignment_id}",
    }
    fields.update(changes)
    return ResultReport(**fields)  # type: ignore[arg-type]


async def test_targeted_batch_mixes_redelivery_new_claims_and_nothing(world: World) -> None:
    ids = [d.device_id for d in world.devices]
    older = [t for i in range(3) for t in await world.tasks(1, targets=(ids[i],))]
    newer = [t for i in range(3) for t in await world.tasks(1, targets=(ids[i],))]
    held = await world.store.claim_task(ids[0], world.job.job_id, world.clock.now(), LEASE)
    assert held is not None and held.task_id == older[0].task_id

    claimed = await world.store.claim_tasks(ask(world, 0, 1, 2, 3, 1), world.clock.now(), LEASE)

    assert claimed[0] == held  # re-delivery, not its newer task
    assert [c.task_id if c else None for c in claimed[1:4]] == [older[1].task_id, older[2].task_id, None]
    assert claimed[4] == claimed[1]  # asked twice in the batch: one assignment
    assert all(c.slot == 0 and c.state is AssignmentState.LEASED for c in claimed if c is not None)
    # Once those are reported, the next batch gets each device its newer task.
    outcomes = await world.store.record_results(
        [report(c) for c in claimed[:3] if c is not None], world.clock.now()
    )
    assert all(not isinstance(o, Exception) and o.outcome is ReportOutcome.ACCEPTED for o in outcomes)
    again = await world.store.claim_tasks(ask(world, 0, 1, 2), world.clock.now(), LEASE)
    assert [c.task_id if c else None for c in again] == [t.task_id for t in newer]


async def test_targets_shared_by_a_batch_take_distinct_slots(world: World) -> None:
    ids = [d.device_id for d in world.devices]
    (shared,) = await world.tasks(1, slots=2, targets=ids[:4])
    (spare,) = await world.tasks(1)  # untargeted: for those the shared task has no slot left

    claimed = await world.store.claim_tasks(ask(world, 0, 1, 2, 3, 4), world.clock.now(), LEASE)

    got = [c for c in claimed if c is not None]
    on_shared = [c for c in got if c.task_id == shared.task_id]
    assert sorted(c.slot for c in on_shared) == [0, 1]
    assert len({c.device_id for c in on_shared}) == 2
    assert [c.task_id for c in got if c.task_id == spare.task_id] == [spare.task_id]
    assert sum(c is None for c in claimed) == 2


async def test_targeted_and_untargeted_in_one_batch(world: World) -> None:
    ids = [d.device_id for d in world.devices]
    (mine,) = await world.tasks(1, targets=(ids[0],))
    (anyone,) = await world.tasks(1, slots=2)

    claimed = await world.store.claim_tasks(ask(world, 0, 1, 2, 3), world.clock.now(), LEASE)

    assert [c.task_id if c else None for c in claimed] == [
        mine.task_id,
        anyone.task_id,
        anyone.task_id,
        None,
    ]


async def test_expired_lease_is_not_redelivered_and_its_task_not_retaken(world: World) -> None:
    ids = [d.device_id for d in world.devices]
    (first,) = await world.tasks(1, targets=(ids[0],))
    (second,) = await world.tasks(1, targets=(ids[0],))
    held = await world.store.claim_task(ids[0], world.job.job_id, world.clock.now(), LEASE)
    assert held is not None and held.task_id == first.task_id
    world.clock.advance(LEASE)

    (claimed,) = await world.store.claim_tasks(ask(world, 0), world.clock.now(), LEASE)

    assert claimed is not None and claimed.task_id == second.task_id


async def test_report_batch_settles_each_item_like_single_reports(world: World) -> None:
    ids = [d.device_id for d in world.devices]
    for i in range(6):
        await world.tasks(1, targets=(ids[i],))
    held = await world.store.claim_tasks(ask(world, 0, 1, 2, 3, 4, 5), world.clock.now(), LEASE)
    a = [h for h in held if h is not None]
    assert len(a) == 6
    earlier = await world.store.record_result(report(a[4]), world.clock.now())
    ghost = report(a[0], request_id="ghost")
    ghost = ResultReport(**{**{f: getattr(ghost, f) for f in ghost.__slots__}, "assignment_id": "f" * 32})
    batch = [
        report(a[0]),
        report(a[1], status=ResultStatus.FAILED, payload_sha256=None, error_message="boom"),
        report(a[2], device_id=ids[3]),
        report(a[0], request_id="retry-by-digest"),  # the same report again, in the same batch
        report(a[4], request_id="other", report_digest="different"),  # already has another result
        report(a[4]),  # a retry of the earlier report
        ghost,
        report(a[3]),
        report(a[0], request_id="x", report_digest="a different report in the same batch"),
    ]

    out = await world.store.record_results(batch, world.clock.now())

    assert not isinstance(out[0], Exception) and out[0].outcome is ReportOutcome.ACCEPTED
    assert not out[0].duplicate and out[0].result.accepted and out[0].result.payload_sha256 == SHA
    assert not isinstance(out[1], Exception) and not out[1].result.accepted
    assert out[1].result.payload_sha256 is None and out[1].result.error_message == "boom"
    assert isinstance(out[2], PermissionDenied)
    assert not isinstance(out[3], Exception) and out[3].duplicate and out[3].result == out[0].result
    assert isinstance(out[4], Conflict)
    assert not isinstance(out[5], Exception) and out[5].duplicate and out[5].result == earlier.result
    assert isinstance(out[6], NotFound)
    assert not isinstance(out[7], Exception) and out[7].outcome is ReportOutcome.ACCEPTED
    assert isinstance(out[8], Conflict)
    states = [(await world.store.get_assignment(x.assignment_id)).state for x in a]
    done, failed, leased = AssignmentState.COMPLETED, AssignmentState.FAILED, AssignmentState.LEASED
    assert states == [done, failed, leased, done, done, leased]


async def test_report_batch_with_late_reports_is_stale(world: World) -> None:
    ids = [d.device_id for d in world.devices]
    for i in range(3):
        await world.tasks(1, targets=(ids[i],))
    a = [h for h in await world.store.claim_tasks(ask(world, 0, 1, 2), world.clock.now(), LEASE) if h]
    world.clock.advance(LEASE)
    (reaped,) = [x for x in await world.store.expire_leases(world.clock.now()) if x.device_id == ids[2]]

    out = await world.store.record_results([report(x) for x in a], world.clock.now())

    assert all(not isinstance(o, Exception) and o.outcome is ReportOutcome.STALE for o in out)
    assert all(not isinstance(o, Exception) and o.result.payload_sha256 is None for o in out)
    states = {x.assignment_id: (await world.store.get_assignment(x.assignment_id)).state for x in a}
    assert set(states.values()) == {AssignmentState.EXPIRED}
    assert reaped.assignment_id in states


async def test_concurrent_claim_batches_never_double_assign(world: World, more_stores: StoreFactory) -> None:
    """Eight stores claim batches at once for overlapping devices on shared targeted multi-slot tasks."""
    devices = [d.device_id for d in world.devices]
    slots = 3
    created = await world.tasks(6, slots=slots, targets=devices)
    stores: list[SqlStateStore] = [await more_stores() for _ in range(8)]
    requests = [ClaimRequest(device_id=d, job_id=world.job.job_id) for d in devices]

    async def claim(store: SqlStateStore, shift: int) -> list[Assignment | None]:
        batch = requests[shift:] + requests[:shift]
        return await store.claim_tasks(batch, world.clock.now(), LEASE)

    results = await asyncio.gather(*(claim(s, i) for i, s in enumerate(stores)))

    got = {a.assignment_id: a for batch in results for a in batch if a is not None}
    per_task = Counter(a.task_id for a in got.values())
    assert all(count <= slots for count in per_task.values())
    assert max(Counter((a.task_id, a.slot) for a in got.values()).values()) == 1
    assert max(Counter((a.task_id, a.device_id) for a in got.values()).values()) == 1
    assert {a.device_id for a in got.values()} == set(devices)
    assert {a.task_id for a in got.values()} <= {t.task_id for t in created}


async def test_a_report_batch_stores_its_inline_payloads_with_the_results(world: World) -> None:
    ids = [d.device_id for d in world.devices]
    await world.tasks(2)
    claimed = await world.store.claim_tasks(ask(world, 0, 1), world.clock.now(), LEASE)
    datas = [b"payload of device 0", b"payload of device 1"]
    shas = [hashlib.sha256(d).hexdigest() for d in datas]
    held = [c for c in claimed if c is not None]
    assert [c.device_id for c in held] == ids[:2]

    outcomes = await world.store.record_results(
        [report(c, payload_sha256=sha) for c, sha in zip(held, shas, strict=True)],
        world.clock.now(),
        payloads=list(zip(shas, datas, strict=True)),
    )

    assert all(not isinstance(o, Exception) and o.outcome is ReportOutcome.ACCEPTED for o in outcomes)
    assert [await world.store.blobs.read(sha) for sha in shas] == datas
    recorded = {
        r.device_id: r.payload_sha256
        for t in {c.task_id for c in held}
        for r in await world.store.list_results(task_id=t)
    }
    assert recorded == dict(zip(ids[:2], shas, strict=True))
