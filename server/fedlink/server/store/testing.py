"""Helpers for tests of the store and of code built on it: throwaway PostgreSQL databases, a scenario.

Nothing here is used by the coordinator itself.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

from sqlalchemy.engine import make_url

from fedlink.server.domain import Device, Job, ManualClock, Run, Task
from fedlink.server.store.protocol import NewJob, NewTask
from fedlink.server.store.sql import SqlStateStore

StoreFactory = Callable[[], Awaitable[SqlStateStore]]


def asyncpg_dsn(url: str) -> str:
    """Turn a ``postgresql+asyncpg://`` URL into a DSN asyncpg.connect takes."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


async def _admin(admin_url: str, sql: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(asyncpg_dsn(admin_url), timeout=5)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def create_pg_database(admin_url: str, prefix: str = "fedlink_test") -> str:
    """Create an empty database on the server of ``admin_url`` and return its URL."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    asyncio.run(_admin(admin_url, f'CREATE DATABASE "{name}"'))
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def drop_pg_database(admin_url: str, url: str) -> None:
    """Drop a database made by :func:`create_pg_database`, disconnecting whoever still uses it."""
    name = make_url(url).database
    asyncio.run(_admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@dataclass
class World:
    """A job with a run and enrolled devices, plus a shortcut to make tasks for it."""

    store: SqlStateStore
    clock: ManualClock
    job: Job
    run: Run
    devices: list[Device]

    async def tasks(
        self,
        count: int = 1,
        *,
        slots: int = 1,
        round: int = 1,
        deadline: timedelta = timedelta(minutes=10),
        targets: Sequence[str] = (),
        payload_sha256: str | None = None,
    ) -> Sequence[Task]:
        """Create ``count`` OPEN tasks of the run, one clock tick apart so their order is known."""
        made: list[Task] = []
        for _ in range(count):
            new = NewTask(
                job_id=self.job.job_id,
                run_id=self.run.run_id,
                round=round,
                name="train",
                payload_sha256=payload_sha256,
                deadline=self.clock.now() + deadline,
                slots=slots,
                targets=targets,
            )
            made.extend(await self.store.create_tasks([new]))
            self.clock.advance(timedelta(microseconds=1))
        return made


async def make_world(store: SqlStateStore, clock: ManualClock, *, devices: int = 8) -> World:
    """Enroll ``devices`` devices and create a job with a run driven by ``coordinator-1``."""
    enrolled = [
        await store.enroll_device({"os": "linux", "n": str(i)}, {}, f"cred-{i}") for i in range(devices)
    ]
    job = await store.create_job(NewJob(name="mnist", spec_json='{"workflow": "fedavg"}', job_data="{}"))
    run = await store.create_run(
        job.job_id, owner="coordinator-1", now=clock.now(), lease=timedelta(seconds=30)
    )
    return World(store=store, clock=clock, job=job, run=run, devices=enrolled)
