"""Job progress events: stored in order, and pushed to watchers as they happen."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fedlink.server.domain import Job, JobEvent, JobState, RunFence, is_final, job_event_json
from fedlink.server.store import StateStore

#: The event that reports a job's state change; its payload has "state" and "message".
JOB_STATE_CHANGED = "job_state_changed"


class JobEvents:
    """Appends job events to the store and wakes whoever watches the job."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._wakeups: dict[str, asyncio.Event] = {}
        #: Called with ``(job, kind, round, payload)`` after each event is stored (e.g. the experiment
        #: tracker's queue); a listener must not block or raise.
        self.listeners: list[Callable[[Job, str, int, Mapping[str, Any]], None]] = []

    async def emit(
        self,
        job: Job,
        kind: str,
        round: int,
        payload: Mapping[str, Any],
        *,
        fence: RunFence | None = None,
    ) -> None:
        """Records an event of ``job`` and wakes its watchers; with a ``fence`` (a driver's), only while
        it holds the job's run (else RunLeaseLost, and nothing recorded)."""
        await self._store.append_job_event(job.job_id, kind, job_event_json(round, payload), fence=fence)
        self.told(job, kind, round, payload)

    def told(self, job: Job, kind: str, round: int, payload: Mapping[str, Any]) -> None:
        """An event of ``job`` is stored (by :meth:`emit`, or in a write of the caller's own, in the form
        of :func:`~fedlink.server.domain.job_event_json`): wakes its watchers and tells the listeners."""
        self.wake(job.job_id)
        for listener in self.listeners:
            listener(job, kind, round, payload)

    async def set_state(
        self, job_id: str, state: JobState, message: str = "", *, fence: RunFence | None = None
    ) -> Job:
        """Moves the job to ``state`` and records its ``job_state_changed`` event in the same write (a
        watcher that sees a final job finds its final event), then wakes its watchers."""
        payload = {"state": state.value, "message": message}
        job = await self._store.set_job_state(
            job_id, state, message, fence=fence, event=(JOB_STATE_CHANGED, job_event_json(0, payload))
        )
        self.told(job, JOB_STATE_CHANGED, 0, payload)
        return job

    def wake(self, job_id: str) -> None:
        """Wakes the watchers of ``job_id``."""
        event = self._wakeups.pop(job_id, None)
        if event is not None:
            event.set()

    async def watch(
        self, job_id: str, *, after_sequence: int = 0, poll_seconds: float = 1.0
    ) -> AsyncIterator[JobEvent]:
        """Yields the job's events after ``after_sequence`` as they come, until the job is final.

        Polls the store as well as waiting for wake-ups, so events written by another coordinator
        replica are seen too.
        """
        cursor = after_sequence
        final_seen = False
        while True:
            event = self._wakeups.get(job_id)
            if event is None:
                event = self._wakeups[job_id] = asyncio.Event()
            batch = await self._store.list_job_events(job_id, after_sequence=cursor)
            for item in batch:
                cursor = item.sequence
                yield item
                if item.kind == JOB_STATE_CHANGED and is_final(
                    JobState(json.loads(item.payload_json)["state"])
                ):
                    return
            if batch:
                final_seen = False
            else:
                if final_seen:
                    return  # final without a stored state event (e.g. deleted history): nothing more
                # The job's final state is written just before its event: one more look for the event
                # (after its wake-up, or a poll), or a watcher could miss the job's end.
                final_seen = is_final((await self._store.get_job(job_id)).state)
                try:
                    async with asyncio.timeout(poll_seconds):
                        await event.wait()
                except TimeoutError:
                    pass


def event_state(event: JobEvent) -> JobState:
    """The state a ``job_state_changed`` event reports."""
    return JobState(json.loads(event.payload_json)["state"])
