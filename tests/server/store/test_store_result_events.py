"""Contract: every result that counts adds a result_received job event, in the same transaction."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

from fedlink.common.errors import NotFound
from fedlink.server.domain import Assignment, JobEvent, ResultStatus
from fedlink.server.store import RecordOutcome, ResultReport, SqlStateStore
from fedlink.server.store.testing import StoreFactory, World

LEASE = timedelta(seconds=30)


def _report(held: Assignment, status: ResultStatus = ResultStatus.SUCCEEDED, tag: str = "") -> ResultReport:
    succeeded = status is ResultStatus.SUCCEEDED
    return ResultReport(
        assignment_id=held.assignment_id,
        device_id=held.device_id,
        status=status,
        payload_sha256=("a" * 64) if succeeded else None,
        report_digest=f"digest-{held.assignment_id}{tag}",
        request_id=f"req-{held.assignment_id}{tag}",
        error_message="" if succeeded else "executor failed",
    )


async def _claim_all(world: World, devices: int) -> list[Assignment]:
    held = []
    for device in world.devices[:devices]:
        assignment = await world.store.claim_task(
            device.device_id, world.job.job_id, world.clock.now(), LEASE
        )
        assert assignment is not None
        held.append(assignment)
    return held


async def _events(store: SqlStateStore, job_id: str) -> list[JobEvent]:
    return list(await store.list_job_events(job_id))


def _bodies(events: list[JobEvent]) -> list[dict[str, object]]:
    return [json.loads(e.payload_json) for e in events if e.kind == "result_received"]


async def test_counted_results_add_events_numbered_after_the_jobs_others(world: World) -> None:
    await world.store.append_job_event(world.job.job_id, "round_started", json.dumps({"round": 1}))
    targets = [d.device_id for d in world.devices[:4]]
    for device_id in targets:
        await world.tasks(1, targets=(device_id,))
    held = await _claim_all(world, 4)
    batch = [_report(held[0]), _report(held[1], ResultStatus.FAILED), _report(held[2])]
    outcomes = await world.store.record_results(batch, world.clock.now())
    assert all(isinstance(o, RecordOutcome) for o in outcomes)
    await world.store.record_result(_report(held[3]), world.clock.now())

    events = await _events(world.store, world.job.job_id)
    assert [e.sequence for e in events] == [1, 2, 3, 4, 5]
    assert [e.kind for e in events] == ["round_started"] + ["result_received"] * 4
    assert _bodies(events) == [
        {"round": 1, "device_id": held[0].device_id, "status": "SUCCEEDED", "num_results": 1},
        {
            "round": 1,
            "device_id": held[1].device_id,
            "status": "FAILED",
            "num_results": 1,
            "error": "executor failed",  # the device's reason, for job watch
        },
        {"round": 1, "device_id": held[2].device_id, "status": "SUCCEEDED", "num_results": 2},
        {"round": 1, "device_id": held[3].device_id, "status": "SUCCEEDED", "num_results": 3},
    ]


async def test_retries_late_reports_and_refused_ones_add_no_event(world: World) -> None:
    for device in world.devices[:2]:
        await world.tasks(1, targets=(device.device_id,))
    first, late = await _claim_all(world, 2)
    await world.store.record_result(_report(first), world.clock.now())
    again = await world.store.record_result(_report(first), world.clock.now())  # a retry: same outcome
    assert again.duplicate
    now = world.clock.advance(LEASE + timedelta(seconds=1))
    stale = await world.store.record_result(_report(late), now)  # recorded, counts for nothing
    assert stale.result.stale
    unknown = ResultReport(
        assignment_id="no-such-assignment",
        device_id=first.device_id,
        status=ResultStatus.SUCCEEDED,
        payload_sha256="a" * 64,
        report_digest="d",
        request_id="r",
        error_message="",
    )
    (refused,) = await world.store.record_results([unknown], now)
    assert isinstance(refused, NotFound)

    bodies = _bodies(await _events(world.store, world.job.job_id))
    assert bodies == [{"round": 1, "device_id": first.device_id, "status": "SUCCEEDED", "num_results": 1}]


async def test_each_round_counts_its_own_results(world: World) -> None:
    device = world.devices[0].device_id
    for round_no in (1, 2):
        await world.tasks(1, round=round_no, targets=(device,))
        (held,) = await _claim_all(world, 1)
        await world.store.record_result(_report(held), world.clock.now())
    bodies = _bodies(await _events(world.store, world.job.job_id))
    assert [(b["round"], b["num_results"]) for b in bodies] == [(1, 1), (2, 1)]


async def test_concurrent_appenders_of_one_job_number_their_events_without_gaps(
    world: World, more_stores: StoreFactory
) -> None:
    # Result batches and other events of one job, from several stores (connections) at once.
    devices = [d.device_id for d in world.devices]
    for device_id in devices:
        await world.tasks(1, targets=(device_id,))
    held = await _claim_all(world, len(devices))
    stores = [await more_stores() for _ in range(4)]
    halves = [held[: len(held) // 2], held[len(held) // 2 :]]
    notes = (
        stores[2 + i % 2].append_job_event(world.job.job_id, "note", json.dumps({"round": 1, "i": i}))
        for i in range(10)
    )
    first, second, _ = await asyncio.gather(
        stores[0].record_results([_report(a) for a in halves[0]], world.clock.now()),
        stores[1].record_results([_report(a) for a in halves[1]], world.clock.now()),
        asyncio.gather(*notes),
    )
    assert all(isinstance(o, RecordOutcome) for o in [*first, *second])

    events = await _events(world.store, world.job.job_id)
    assert [e.sequence for e in events] == list(range(1, len(devices) + 11))
    bodies = _bodies(events)
    assert sorted(str(b["device_id"]) for b in bodies) == sorted(devices)
    # Counts rise with the sequence: each batch counted what had committed before it, and itself.
    assert [b["num_results"] for b in bodies] == list(range(1, len(devices) + 1))
