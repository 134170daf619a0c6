"""Wake-ups for long-polling devices.

A GetTask long poll waits until its job may have a task for it. Workflows call :meth:`notify` when they
create tasks (or a slot frees up); waiters re-check the store. The interface is small so that a
PostgreSQL LISTEN/NOTIFY implementation can wake waiters on other coordinator replicas later.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class TaskNotifier(Protocol):
    """Wakes devices waiting for tasks of a job."""

    def notify(self, job_id: str) -> None:
        """Signals that ``job_id`` may have new work."""

    async def wait(self, job_id: str, seconds: float) -> bool:
        """Waits up to ``seconds`` for a notification; True if one came."""


class LocalTaskNotifier:
    """In-process notifier: one event per job, replaced on each notification."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def notify(self, job_id: str) -> None:
        """Wakes every current waiter of ``job_id``."""
        event = self._events.pop(job_id, None)
        if event is not None:
            event.set()

    def notify_all(self) -> None:
        """Wakes every waiter (e.g. on shutdown)."""
        events, self._events = self._events, {}
        for event in events.values():
            event.set()

    async def wait(self, job_id: str, seconds: float) -> bool:
        """Waits up to ``seconds`` for :meth:`notify` of ``job_id``."""
        event = self._events.get(job_id)
        if event is None:
            event = self._events[job_id] = asyncio.Event()
        try:
            async with asyncio.timeout(seconds):
                await event.wait()
        except TimeoutError:
            return False
        return True
