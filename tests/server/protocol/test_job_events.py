"""Job event streams on a real SQLite store: a job's state and its state event are one write, and a
watcher sees the job's end even when it finds the final state before its event (an event written on
its own, as a coordinator before this release did)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from fedlink.common.errors import IllegalTransition
from fedlink.server.domain import JobState, WorkflowSpec
from fedlink.server.protocol.events import JOB_STATE_CHANGED, JobEvents, event_state
from fedlink.server.store import NewJob, SqlStateStore, create_store


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqlStateStore]:
    s = await create_store(f"sqlite+aiosqlite:///{tmp_path / 'events.db'}", auto_migrate=True)
    yield s
    await s.close()


async def test_a_watcher_sees_the_final_event_written_after_the_final_state(store: SqlStateStore) -> None:
    events = JobEvents(store)
    spec = WorkflowSpec(name="fedavg", config={"num_rounds": 1})
    job = await store.create_job(NewJob(name="j", spec_json=spec.to_json(), job_data="{}"))
    job = await events.set_state(job.job_id, JobState.RUNNING)
    seen = []
    first = asyncio.Event()

    async def watch() -> None:
        async for item in events.watch(job.job_id, poll_seconds=5.0):
            seen.append(item)
            first.set()

    watcher = asyncio.create_task(watch())
    await asyncio.wait_for(first.wait(), 10)  # the watcher read the RUNNING event and waits for more
    await asyncio.sleep(0.05)
    job = await store.set_job_state(job.job_id, JobState.FINISHED)  # the state alone
    events.wake(job.job_id)  # a wake-up between the state's write and its event's: it finds no event
    await asyncio.sleep(0.2)
    assert not watcher.done(), "the watcher ended without the job's final event"
    await events.emit(job, JOB_STATE_CHANGED, 0, {"state": "FINISHED", "message": ""})
    await asyncio.wait_for(watcher, 10)
    assert [event_state(e) for e in seen if e.kind == JOB_STATE_CHANGED] == [
        JobState.RUNNING,
        JobState.FINISHED,
    ]


async def test_a_final_job_without_its_event_ends_the_watch(store: SqlStateStore) -> None:
    events = JobEvents(store)
    spec = WorkflowSpec(name="fedavg", config={"num_rounds": 1})
    job = await store.create_job(NewJob(name="j", spec_json=spec.to_json(), job_data="{}"))
    await store.set_job_state(job.job_id, JobState.ABORTED)  # its history deleted, or never written
    seen = [e async for e in events.watch(job.job_id, poll_seconds=0.05)]
    assert seen == []


async def test_a_state_and_its_event_are_written_together(store: SqlStateStore) -> None:
    events = JobEvents(store)
    heard: list[tuple[str, str]] = []
    events.listeners.append(lambda job, kind, round, payload: heard.append((kind, payload["state"])))
    spec = WorkflowSpec(name="fedavg", config={"num_rounds": 1})
    job = await store.create_job(NewJob(name="j", spec_json=spec.to_json(), job_data="{}"))
    running = await events.set_state(job.job_id, JobState.RUNNING)
    assert running.state is JobState.RUNNING
    [event] = await store.list_job_events(job.job_id)
    assert (event.kind, event_state(event), event.time) == (
        JOB_STATE_CHANGED,
        JobState.RUNNING,
        running.updated_at,
    )
    assert heard == [(JOB_STATE_CHANGED, "RUNNING")]
    # A move the state machine refuses writes neither.
    with pytest.raises(IllegalTransition):
        await events.set_state(job.job_id, JobState.PENDING)
    assert len(await store.list_job_events(job.job_id)) == 1 and heard == [(JOB_STATE_CHANGED, "RUNNING")]
