"""Wake-ups for long-polling devices.

A GetTask long poll waits until its job may have a task for it. Workflows call :meth:`notify` when they
create tasks (or a slot frees up); waiters re-check the store. A waiter is taken *before* the store is
checked, so a notification that lands between the check and the wait is not lost. On PostgreSQL,
:class:`~fedlink.server.coordination.pg_notify.PgTaskNotifier` (LISTEN/NOTIFY) also wakes the waiters of
the other replicas sharing the database.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Protocol


class Waiter(Protocol):
    """One pending wait for a job's next notification."""

    async def wait(self, seconds: float) -> bool:
        """Waits up to ``seconds``; True if a notification came (possibly before this call)."""
        ...


class TaskNotifier(Protocol):
    """Wakes devices waiting for tasks of a job."""

    def notify(self, job_id: str, devices: Collection[str] | None = None) -> None:
        """Signals that ``job_id`` may have new work: for these devices only, or (None) for all."""

    def notify_all(self) -> None:
        """Wakes every waiter (e.g. on shutdown)."""

    def waiter(self, job_id: str, device_id: str) -> Waiter:
        """Returns a waiter for the next notification of ``job_id`` that concerns ``device_id``."""
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
    """In-process notifier: one event per waiting (job, device), replaced on each notification.

    A task handed to one device wakes that device alone, not every device polling the job.
    """

    def __init__(self) -> None:
        self._events: dict[str, dict[str, asyncio.Event]] = {}

    def notify(self, job_id: str, devices: Collection[str] | None = None) -> None:
        """Wakes the current waiters of ``job_id``: of ``devices`` only, or all of them."""
        waiting = self._events.get(job_id)
        if not waiting:
            return
        if devices is None:
            del self._events[job_id]
            for event in waiting.values():
                event.set()
            return
        for device in devices:
            if device in waiting:
                waiting.pop(device).set()

    def notify_all(self) -> None:
        """Wakes every waiter of every job."""
        events, self._events = self._events, {}
        for waiting in events.values():
            for event in waiting.values():
                event.set()

    def waiter(self, job_id: str, device_id: str) -> Waiter:
        """Returns a waiter for the next :meth:`notify` of ``job_id`` that includes ``device_id``."""
        waiting = self._events.setdefault(job_id, {})
        event = waiting.get(device_id)
        if event is None:
            event = waiting[device_id] = asyncio.Event()
        return _EventWaiter(event)
