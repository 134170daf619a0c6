"""While the database is away, ask it every second whether it answers again.

The store marks itself away when a call spent its retry budget on broken connections, and available
again at the next call that succeeds (see :mod:`fedlink.server.store.outages`). Calls come at their own
pace (a device's retry, the supervisor's scan): this probe makes the way back, and with it health
SERVING, follow the database within a second whatever else is going on.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from fedlink.server.services.loops import Loop
from fedlink.server.store.dialect import Database


class StoreProbe:
    """Probes the database while its store is away (its loop runs in the coordinator's task group)."""

    def __init__(self, database: Database, *, interval: timedelta = timedelta(seconds=1)) -> None:
        self._database = database
        self._interval = interval.total_seconds()

    def loop(self) -> Loop:
        """The probe as a background loop: a ``SELECT 1`` every ``interval`` while the store is away."""
        return Loop(name="store-probe", step=self.step, pause=self._pause)

    async def step(self) -> None:
        """One probe, if the store is away (an answer marks it available again)."""
        if not self._database.availability.available:
            await self._database.probe()

    async def _pause(self) -> None:
        await asyncio.sleep(self._interval)
