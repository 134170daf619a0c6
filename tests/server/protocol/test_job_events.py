"""Job event streams on a real SQLite store: a watcher sees the job's end even when it reads the job's
final state in the moment between that state's write and its event's (the supervisor writes them one
after the other)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

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
    job = await store.set_job_state(job.job_id, JobState.RUNNING)
    await events.state_changed(job, JobState.RUNNING)
    seen = []
    first = asyncio.Event()

    async def watch() -> None:
        async for item in events.watch(job.job_id, poll_seconds=5.0):
            seen.append(item)
            first.set()

    watcher = asyncio.create_task(watch())
    await asyncio.wait_for(first.wait(), 10)  # the watcher read the RUNNING event and waits for more
    await asyncio.sleep(0.05)
    job = await store.set_job_state(job.job_id, JobState.FINISHED)
    events.wake(job.job_id)  # a wake-up between the state's write and its event's: it finds no event
    await asyncio.sleep(0.2)
    assert not watcher.done(), "the watcher ended without the job's final event"
    await events.state_changed(job, JobState.FINISHED)
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
