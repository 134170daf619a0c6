"""Periodic upkeep: expire leases, record devices seen, mark silent devices offline."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import timedelta

from fedlink.server.coordination.notify import TaskNotifier
from fedlink.server.domain import Clock
from fedlink.server.services.loops import Loop
from fedlink.server.store import StateStore

log = logging.getLogger(__name__)


class Maintenance:
    """The coordinator's upkeep (its loop is run by :class:`~fedlink.server.services.loops.BackgroundLoops`,
    which retries a failing tick)."""

    def __init__(
        self,
        store: StateStore,
        *,
        clock: Clock,
        notifier: TaskNotifier,
        drain_seen: Callable[[], set[str]],
        on_run_progress: Callable[[str], None],
        interval: timedelta,
        offline_after: timedelta,
    ) -> None:
        self._store = store
        self._clock = clock
        self._notifier = notifier
        self._drain_seen = drain_seen
        self._on_run_progress = on_run_progress
        self._interval = interval.total_seconds()
        self._offline_after = offline_after
        # Silent devices are looked for a few times per offline window, at most every tenth tick (the
        # sweep reads every ONLINE device's last-seen time; a tick's other work is much lighter).
        self._offline_every = max(1, min(10, int(offline_after / interval / 3)))
        self._ticks = 0

    def loop(self) -> Loop:
        """Upkeep as a background loop: a tick every ``interval`` (offline devices every few)."""
        return Loop(name="maintenance", step=self._step, pause=self._pause)

    async def _step(self) -> None:
        await self.tick(mark_offline=self._ticks % self._offline_every == 0)
        self._ticks += 1

    async def _pause(self) -> None:
        await asyncio.sleep(self._interval)

    async def tick(self, *, mark_offline: bool = True) -> None:
        """One round of upkeep."""
        now = self._clock.now()
        seen = self._drain_seen()
        if seen:
            await self._store.touch_devices(sorted(seen), now)
        for job_id in {a.job_id for a in await self._store.expire_leases(now)}:
            self._on_run_progress(job_id)  # the workflow may hand the task to another device
            self._notifier.notify(job_id)
        if mark_offline:
            await self._store.mark_offline(now - self._offline_after)
