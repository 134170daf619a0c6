"""Helpers for tests of the store and of code built on it: throwaway PostgreSQL databases, a scenario.

Nothing here is used by the coordinator itself.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url

from fedlink.server.domain import Device, Job, ManualClock, Run, Task
from fedlink.server.store.dialect import APPLICATION_NAME, Database
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
    run = await store.acquire_job_run(
        job.job_id, owner="coordinator-1", now=clock.now(), lease=timedelta(seconds=30)
    )
    return World(store=store, clock=clock, job=job, run=run, devices=enrolled)


class PgFaults:
    """Breaks a store's PostgreSQL connections on purpose, as a restart, a failover or an operator's
    ``pg_terminate_backend`` would: for tests of how the store and the coordinator ride that out.

    Connections are terminated by the real server. :meth:`terminate` ends every connection fedlink has
    to the database (by ``application_name``, so the test's own connections live on); the armed faults
    end the store's own connection at a chosen point of its work, from inside that very connection:
    :meth:`kill_before` right before a statement runs (a transaction cut off before its commit), and
    :meth:`lose_commit` during a commit (the commit done but its answer lost, or not done).
    ``async with PgFaults(database, url) as faults:`` (the hooks are removed on exit, and the database
    given back). ``maintenance_database`` is where :meth:`refuse` and :meth:`allow` run (a database
    cannot refuse connections from its own session).
    """

    def __init__(self, database: Database, url: str, *, maintenance_database: str = "postgres") -> None:
        self._database = database
        self._url = url
        self._maintenance_url = make_url(url).set(database=maintenance_database).render_as_string(False)
        self._admin: Any = None
        self._kills: list[tuple[re.Pattern[str], int]] = []
        self._commits: list[tuple[re.Pattern[str], bool]] = []
        #: The pooled connections whose open transaction ran a statement a commit fault waits for.
        self._marked: dict[int, list[tuple[re.Pattern[str], bool]]] = {}
        #: The driver connection under each marked pooled one (what the pool's invalidate event names).
        self._drivers: dict[int, int] = {}
        #: How many faults fired, by kind ("terminated", "killed", "commit lost", "commit cut").
        self.fired: Counter[str] = Counter()
        self._refused = False
        self._admin_lock = asyncio.Lock()  # one statement at a time on the admin connection
        self._dialect = database.engine.sync_engine.dialect
        self._do_commit = self._dialect.do_commit

    async def __aenter__(self) -> PgFaults:
        import asyncpg

        self._admin = await asyncpg.connect(
            asyncpg_dsn(self._url), timeout=10, server_settings={"application_name": "fedlink-test-faults"}
        )
        sync_engine = self._database.engine.sync_engine
        event.listen(sync_engine, "before_cursor_execute", self._before_statement)
        event.listen(sync_engine, "rollback", self._after_rollback)
        event.listen(sync_engine, "invalidate", self._after_invalidate)
        setattr(self._dialect, "do_commit", self._commit)  # noqa: B010 - this engine's dialect only
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        sync_engine = self._database.engine.sync_engine
        event.remove(sync_engine, "before_cursor_execute", self._before_statement)
        event.remove(sync_engine, "rollback", self._after_rollback)
        event.remove(sync_engine, "invalidate", self._after_invalidate)
        setattr(self._dialect, "do_commit", self._do_commit)  # noqa: B010
        try:
            await self.allow()
        finally:
            await self._admin.close()

    async def terminate(self) -> int:
        """Terminates every connection of fedlink to the database now; returns how many there were."""
        async with self._admin_lock:
            count = int(
                await self._admin.fetchval(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = "
                    "current_database() AND application_name = $1 AND pid <> pg_backend_pid()",
                    APPLICATION_NAME,
                )
            )
        self.fired["terminated"] += 1
        return count

    async def refuse(self) -> None:
        """Takes the database away: new connections are refused, and fedlink's are terminated."""
        await _admin(
            self._maintenance_url, f'ALTER DATABASE "{self._database_name()}" ALLOW_CONNECTIONS false'
        )
        self._refused = True
        await self.terminate()

    async def allow(self) -> None:
        """Gives the database back: connections are accepted again."""
        if self._refused:
            await _admin(
                self._maintenance_url, f'ALTER DATABASE "{self._database_name()}" ALLOW_CONNECTIONS true'
            )
            self._refused = False

    def kill_before(self, pattern: str, times: int = 1) -> None:
        """Terminates the store's connection right before each of the next ``times`` statements that
        match ``pattern`` (a regular expression, searched in the SQL): their transaction is cut off."""
        self._kills.append((re.compile(pattern, re.IGNORECASE | re.DOTALL), times))

    def lose_commit(self, pattern: str, *, committed: bool = True) -> None:
        """Terminates the store's connection during the commit of the next transaction that ran a
        statement matching ``pattern``: after the commit is done (its answer is lost) if ``committed``,
        else before (the transaction is rolled back by the server, but the client cannot know)."""
        self._commits.append((re.compile(pattern, re.IGNORECASE | re.DOTALL), committed))

    def armed(self) -> int:
        """How many armed faults have not fired yet."""
        return sum(times for _, times in self._kills) + len(self._commits) + len(self._marked)

    def _database_name(self) -> str:
        name = make_url(self._url).database
        assert name is not None
        return name

    def _before_statement(
        self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
    ) -> None:
        pooled = conn.connection  # what the dialect's do_commit is handed, too
        for index, (pattern, committed) in enumerate(self._commits):
            if pattern.search(statement):
                del self._commits[index]
                self._marked.setdefault(id(pooled), []).append((pattern, committed))
                self._drivers[id(pooled.dbapi_connection)] = id(pooled)
                break
        for index, (pattern, times) in enumerate(self._kills):
            if pattern.search(statement):
                if times <= 1:
                    del self._kills[index]
                else:
                    self._kills[index] = (pattern, times - 1)
                self.fired["killed"] += 1
                _terminate_self(pooled)  # raises: the statement never runs

    def _after_rollback(self, conn: Any) -> None:
        # A transaction that rolled back never commits: its marks wait for the next one.
        try:
            pooled = conn.connection
        except Exception:  # an invalidated connection: _after_invalidate gave its marks back
            return
        marks = self._unmark(id(pooled))
        if marks:
            self._commits[:0] = marks

    def _unmark(self, key: int) -> list[tuple[re.Pattern[str], bool]] | None:
        """The marks of pooled connection ``key``, taken off it (ids are reused: nothing stays behind)."""
        self._drivers = {driver: pooled for driver, pooled in self._drivers.items() if pooled != key}
        return self._marked.pop(key, None)

    def _after_invalidate(self, dbapi_connection: Any, record: Any, exception: Any) -> None:
        # A connection that broke (another fault terminated it mid-transaction) never commits that
        # transaction: its marks wait for the next one, as after a rollback.
        key = self._drivers.get(id(dbapi_connection))
        marks = self._unmark(key) if key is not None else None
        if marks:
            self._commits[:0] = marks

    def _commit(self, dbapi_connection: Any) -> None:
        marks = self._unmark(id(dbapi_connection))
        if not marks:
            self._do_commit(dbapi_connection)
            return
        _, committed = marks[0]
        self._commits[:0] = marks[1:]
        if committed:
            self._do_commit(dbapi_connection)
            self.fired["commit lost"] += 1
        else:
            self.fired["commit cut"] += 1
        _terminate_self(dbapi_connection)


def _terminate_self(dbapi_connection: Any) -> None:
    """Has the server terminate this very connection (raises the driver's connection error)."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    finally:
        cursor.close()
