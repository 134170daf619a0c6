"""Counts for dashboards and metrics: cheap aggregate reads, no rows."""

from __future__ import annotations

import sqlalchemy as sa

from fedlink.server.domain import DeviceState, JobState
from fedlink.server.store.core import StoreCore
from fedlink.server.store.schema import devices, jobs


class StatsQueries(StoreCore):
    """How many devices and jobs are in each state."""

    async def count_devices_by_state(self) -> dict[DeviceState, int]:
        """Return the number of devices in each state (states with none are left out)."""
        query = sa.select(devices.c.state, sa.func.count()).group_by(devices.c.state)
        async with self._db.read() as conn:
            return {DeviceState(state): n for state, n in (await conn.execute(query)).all()}

    async def count_jobs_by_state(self) -> dict[JobState, int]:
        """Return the number of jobs in each state (states with none are left out)."""
        query = sa.select(jobs.c.state, sa.func.count()).group_by(jobs.c.state)
        async with self._db.read() as conn:
            return {JobState(state): n for state, n in (await conn.execute(query)).all()}
