"""Contract: jobs and their state machine, pagination, runs and their lease, checkpoints, events, deletion."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from fedlink.common.errors import FailedPrecondition, IllegalTransition, InvalidArgument, NotFound
from fedlink.server.domain import Job, JobState, ManualClock, ResultStatus, Run, RunLeaseHeld, RunState
from fedlink.server.store import NewJob, ResultReport, SqlStateStore
from fedlink.server.store.testing import World


def new_job(name: str) -> NewJob:
    return NewJob(name=name, spec_json="{}", job_data='{"components": []}', device_selector={"os": "linux"})


async def test_job_round_trip(store: SqlStateStore, clock: ManualClock) -> None:
    job = await store.create_job(new_job("a"))
    assert job.state is JobState.PENDING and job.created_at == clock.now()
    assert job.device_selector == {"os": "linux"}
    assert await store.get_job(job.job_id) == job
    with pytest.raises(NotFound):
        await store.get_job("0" * 32)


async def test_illegal_job_transitions_are_refused(store: SqlStateStore) -> None:
    job = await store.create_job(new_job("a"))
    with pytest.raises(IllegalTransition):
        await store.set_job_state(job.job_id, JobState.FINISHED)
    running = await store.set_job_state(job.job_id, JobState.RUNNING)
    assert running.state is JobState.RUNNING
    failed = await store.set_job_state(job.job_id, JobState.FAILED, "diverged")
    assert (failed.state, failed.message) == (JobState.FAILED, "diverged")
    for target in JobState:
        with pytest.raises(IllegalTransition):
            await store.set_job_state(job.job_id, target)
    assert (await store.get_job(job.job_id)).state is JobState.FAILED


async def test_list_jobs_pages_newest_first(store: SqlStateStore, clock: ManualClock) -> None:
    made = []
    for i in range(7):
        made.append(await store.create_job(new_job(f"job-{i}")))
        if i != 3:  # two jobs share a creation time: the id breaks the tie, stably
            clock.advance(timedelta(seconds=1))
    await store.set_job_state(made[2].job_id, JobState.ABORTED)
    seen: list[Job] = []
    token = ""
    while True:
        page = await store.list_jobs(page_size=3, page_token=token)
        seen.extend(page.items)
        # A job created while paging lands on the first page, never in the middle of a walk.
        await store.create_job(new_job("late"))
        if not (token := page.next_page_token):
            break
    expected = sorted(made, key=lambda j: (j.created_at, j.job_id), reverse=True)
    assert [j.job_id for j in seen if j.name != "late"][: len(made)] == [j.job_id for j in expected]
    aborted = await store.list_jobs(state=JobState.ABORTED)
    assert [j.job_id for j in aborted.items] == [made[2].job_id] and aborted.next_page_token == ""
    with pytest.raises(InvalidArgument):
        await store.list_jobs(page_token="not-a-token")


async def test_coordinators_asking_for_a_job_at_once_make_one_run(
    store: SqlStateStore, clock: ManualClock
) -> None:
    job = await store.create_job(new_job("a"))
    lease = timedelta(seconds=30)
    asks = [store.acquire_job_run(job.job_id, owner=f"c-{i}", now=clock.now(), lease=lease) for i in range(8)]
    outcomes = await asyncio.gather(*asks, return_exceptions=True)
    won = [o for o in outcomes if isinstance(o, Run)]
    held = [o for o in outcomes if isinstance(o, RunLeaseHeld)]
    assert len(won) == 1 and len(held) == 7, outcomes
    run = won[0]
    assert {h.run_id for h in held} == {run.run_id} and {h.owner for h in held} == {run.owner}
    assert (await store.get_current_run(job.job_id)).run_id == run.run_id
    # Its owner asking again renews the same run; another takes it over only once the lease lapsed.
    renewed = await store.acquire_job_run(job.job_id, owner=run.owner or "", now=clock.now(), lease=lease)
    assert (renewed.run_id, renewed.lease_epoch) == (run.run_id, run.lease_epoch)
    later = clock.advance(lease)
    taken = await store.acquire_job_run(job.job_id, owner="c-late", now=later, lease=lease)
    assert (taken.run_id, taken.owner, taken.lease_epoch) == (run.run_id, "c-late", run.lease_epoch + 1)
    with pytest.raises(NotFound):
        await store.acquire_job_run("0" * 32, owner="c-0", now=later, lease=lease)


async def test_run_lease_belongs_to_one_owner(world: World) -> None:
    store, clock, run = world.store, world.clock, world.run
    lease = timedelta(seconds=30)
    assert (await store.get_current_run(world.job.job_id)).run_id == run.run_id
    with pytest.raises(RunLeaseHeld):
        await store.acquire_run_lease(run.run_id, owner="coordinator-2", now=clock.now(), lease=lease)
    renewed = await store.acquire_run_lease(run.run_id, owner="coordinator-1", now=clock.now(), lease=lease)
    assert renewed.owner_lease_expires_at == clock.now() + lease
    later = clock.advance(lease)
    taken = await store.acquire_run_lease(run.run_id, owner="coordinator-2", now=later, lease=lease)
    assert taken.owner == "coordinator-2"
    finished = await store.finish_run(run.run_id, RunState.FINISHED)
    assert finished.state is RunState.FINISHED
    with pytest.raises(IllegalTransition):
        await store.finish_run(run.run_id, RunState.ABORTED)


async def test_checkpoints_keep_the_last_k(world: World) -> None:
    store, run_id = world.store, world.run.run_id
    for round in range(1, 6):
        await store.save_checkpoint(run_id, round, f"{round:064x}", f'{{"loss": {1 / round}}}', keep_last=2)
    kept = await store.list_checkpoints(run_id)
    assert [c.round for c in kept] == [4, 5]
    run = await store.get_run(run_id)
    assert (run.round, run.global_model_sha256) == (5, f"{5:064x}")
    with pytest.raises(InvalidArgument):
        await store.save_checkpoint(run_id, 6, "0" * 64, "{}", keep_last=0)


async def test_job_events_in_order_after_a_sequence(world: World) -> None:
    store, job_id = world.store, world.job.job_id
    events = [await store.append_job_event(job_id, "round_started", f'{{"round": {i}}}') for i in range(5)]
    assert [e.sequence for e in events] == sorted({e.sequence for e in events})
    after = await store.list_job_events(job_id, after_sequence=events[1].sequence)
    assert [e.payload_json for e in after] == [e.payload_json for e in events[2:]]
    with pytest.raises(NotFound):
        await store.list_job_events("0" * 32)


async def test_delete_job_frees_its_blobs_only(world: World) -> None:
    store, clock = world.store, world.clock
    shared = await store.blobs.put_bytes(b"shared initial model")
    own_payload = await store.blobs.put_bytes(b"task payload" * 100)
    own_result = await store.blobs.put_bytes(b"result" * 50)
    checkpoint = await store.blobs.put_bytes(b"checkpoint model")
    job = await store.create_job(
        NewJob(name="x", spec_json="{}", job_data="{}", initial_model_sha256=shared.sha256)
    )
    other = await store.create_job(
        NewJob(name="y", spec_json="{}", job_data="{}", initial_model_sha256=shared.sha256)
    )
    run = await store.acquire_job_run(job.job_id, owner="c", now=clock.now(), lease=timedelta(seconds=5))
    scenario = World(store=store, clock=clock, job=job, run=run, devices=world.devices)
    await scenario.tasks(1, payload_sha256=own_payload.sha256)
    held = await store.claim_task(world.devices[0].device_id, job.job_id, clock.now(), timedelta(seconds=5))
    assert held is not None
    await store.record_result(
        ResultReport(
            assignment_id=held.assignment_id,
            device_id=held.device_id,
            status=ResultStatus.SUCCEEDED,
            payload_sha256=own_result.sha256,
            report_digest="d",
            request_id="r",
        ),
        clock.now(),
    )
    await store.save_checkpoint(run.run_id, 1, checkpoint.sha256, "{}", keep_last=3)
    await store.append_job_event(job.job_id, "done", "{}")

    with pytest.raises(FailedPrecondition):
        await store.delete_job(job.job_id)
    await store.set_job_state(job.job_id, JobState.ABORTED)
    freed = await store.delete_job(job.job_id)
    assert freed == own_payload.size_bytes + own_result.size_bytes + checkpoint.size_bytes
    for gone in (own_payload, own_result, checkpoint):
        assert not await store.blobs.exists(gone.sha256)
    assert await store.blobs.exists(shared.sha256)  # still the other job's initial model
    with pytest.raises(NotFound):
        await store.get_job(job.job_id)
    with pytest.raises(NotFound):
        await store.get_assignment(held.assignment_id)
    assert (await store.get_job(other.job_id)).job_id == other.job_id
