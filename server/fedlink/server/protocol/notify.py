"""Wake-ups for long-polling devices.

A GetTask long poll waits until its job may have a task for it. Workflows call :meth:`notify` when they
create tasks (or a slot frees up); waiters re-check the store. A waiter is taken *before* the store is
checked, so a notification that lands between the check and the wait is not lost. The interface is
small so that a PostgreSQL LISTEN/NOTIFY implementation can wake waiters on other replicas later.
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class Waiter(Protocol):
    """One pending wait for a job's next notification."""

    async def wait(self, seconds: float) -> bool:
        """Waits up to ``seconds``; True if a notification came (possibly before this call)."""
        ...


class TaskNotifier(Protocol):
    """Wakes devices waiting for tasks of a job."""

    def notify(self, job_id: str) -> None:
        """Signals that ``job_id`` may have new work."""

    def notify_all(self) -> None:
        """Wakes every waiter (e.g. on shutdown)."""

    def waiter(self, job_id: str) -> Waiter:
        """Returns a waiter for the next notification of ``job_id`` after this call."""
        ...


class _EventWaiter:
    __slots__ = ("_event",)

    def __init__(self, event: asyncio.Event) -> None:
        self._event = event

    async def wait(self, seconds: float) -> bool:
        if self._event.is_set():
            return True
        try:
            async with asyncio.timeout(seconds):
                await self._event.wait()
        except TimeoutError:
            return False
        return True


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
        """Wakes every waiter of every job."""
        events, self._events = self._events, {}
        for event in events.values():
            event.set()

    def waiter(self, job_id: str) -> Waiter:
        """Returns a waiter for the next :meth:`notify` of ``job_id``."""
        event = self._events.get(job_id)
        if event is None:
            event = self._events[job_id] = asyncio.Event()
        return _EventWaiter(event)
