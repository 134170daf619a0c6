"""Everything that differs between SQLite and PostgreSQL, in one place.

SQLite: WAL, ``synchronous=NORMAL``, foreign keys on, a busy timeout, pysqlite's implicit BEGIN
turned off and write transactions opened with ``BEGIN IMMEDIATE`` (so two writers queue at BEGIN
instead of failing on upgrade from a read lock). ``:memory:`` shares one connection (StaticPool), so
every transaction on it is serialised in-process. PostgreSQL: READ COMMITTED; write transactions are
retried on deadlock and serialization failures; statements are planned afresh on every execution
(``plan_cache_mode=force_custom_plan``), never with a generic plan cached while the tables were small.
Connections the server drops (a restart, a failover, ``pg_terminate_backend``) are replaced, and the
transactions they broke run again, each applied once: see :mod:`fedlink.server.store.outages`.

The hot path's write transactions are written as synchronous SQLAlchemy code (:meth:`Database.write_sync`).
On a SQLite file they run whole in one writer thread on a plain pysqlite connection: aiosqlite hops
between threads for every cursor, execute, fetch and close, and those hops cost more than SQLite's
work. Elsewhere they run through the async connection's ``run_sync``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool

from fedlink.common.errors import InvalidArgument, Unavailable
from fedlink.server.store.outages import (
    ConnectionLost,
    RetryBudget,
    StoreAvailability,
    StoreRetryPolicy,
    StoreUnavailable,
    is_connect_failure,
    is_connection_loss,
    sqlstate,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

SQLITE_BUSY_TIMEOUT_MS = 30_000
#: Connections to a SQLite file in use at once at most (each is an aiosqlite thread).
SQLITE_CONNECTIONS = 15
_WRITE_OPTION = "fedlink_write"
# PostgreSQL SQLSTATEs worth retrying the whole transaction for.
_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})
_MAX_ATTEMPTS = 8
#: The files SQLite keeps beside a database in WAL mode (and, briefly, in rollback mode).
_SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")
#: How PostgreSQL connections of fedlink show in ``pg_stat_activity`` (unless the URL names another).
APPLICATION_NAME = "fedlink"
#: How long opening a PostgreSQL connection may take (asyncpg's default is a minute).
_PG_CONNECT_TIMEOUT_S = 10.0
# The id of the transaction about to commit (NULL if it wrote nothing), and later whether it committed.
_TRANSACTION_ID = sa.text("SELECT pg_current_xact_id_if_assigned()::text::bigint")
_TRANSACTION_STATUS = sa.text("SELECT pg_xact_status(CAST(:xid AS xid8))")
#: The budget a store call spends on broken connections, shared by a read method and its reads.
_BUDGET: ContextVar[RetryBudget | None] = ContextVar("fedlink_store_retry_budget", default=None)


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite ``url`` (None: another database, in memory, or a ``file:`` URI)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or is_memory_sqlite(url):
        return None
    database = parsed.database or ""
    return None if database.startswith("file:") else Path(database)


def is_memory_sqlite(url: str) -> bool:
    """Tell whether ``url`` names an in-memory SQLite database."""
    parsed = make_url(url)
    return parsed.get_backend_name() == "sqlite" and parsed.database in (None, "", ":memory:")


def _on_sqlite_connect(dbapi_connection: Any, _record: Any, memory: bool) -> None:
    # Take transaction control from the driver: BEGIN is emitted by _on_sqlite_begin.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        if not memory:
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    finally:
        cursor.close()


def _on_sqlite_begin(conn: sa.Connection) -> None:
    write = conn.get_execution_options().get(_WRITE_OPTION, False)
    conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def _sqlite_sync_engine(url: str) -> sa.Engine:
    """A plain pysqlite engine on the same SQLite file, with the same settings, for the writer thread."""
    engine = sa.create_engine(
        make_url(url).set(drivername="sqlite+pysqlite"),
        connect_args={"check_same_thread": False},
        pool_size=1,
        max_overflow=0,
    )
    event.listen(engine, "connect", lambda c, r: _on_sqlite_connect(c, r, memory=False))
    event.listen(engine, "begin", _on_sqlite_begin)
    return engine.execution_options(**{_WRITE_OPTION: True})


def _make_sqlite_file_private(path: Path) -> None:
    """Creates a missing SQLite file 0600, and takes group and other access from an existing one.

    The database holds the key that signs cookies. SQLite creates a missing file 0644 (less the umask),
    whatever its directory's mode, and gives its ``-wal`` and ``-shm`` files the database file's mode:
    creating the (empty) file first decides all three. A file of an older version, or its companions,
    made accessible to others, is narrowed here; files of another user are left to the operator.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return  # a missing directory or no permission: SQLite's own error says it when connecting
    try:
        _narrow(path, fd)
    finally:
        os.close(fd)
    for suffix in _SQLITE_COMPANIONS:
        try:
            fd = os.open(f"{path}{suffix}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # none (SQLite creates it with the database file's mode), or not ours to open
        try:
            _narrow(Path(f"{path}{suffix}"), fd)
        finally:
            os.close(fd)


def _narrow(path: Path, fd: int) -> None:
    info = os.fstat(fd)
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077 and info.st_uid == os.getuid():
        os.fchmod(fd, mode & 0o700)
        log.warning("%s was readable by others (mode %04o): made it 0%03o", path, mode, mode & 0o700)


def create_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    """Create the async engine for ``url`` (``sqlite+aiosqlite://`` or ``postgresql+asyncpg://``).

    A SQLite file is created (or narrowed to) owner-only first: see :func:`_make_sqlite_file_private`.
    """
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        memory = is_memory_sqlite(url)
        if not memory and parsed.database and not parsed.database.startswith("file:"):
            _make_sqlite_file_private(Path(parsed.database))
        kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False}}
        if memory:
            kwargs["poolclass"] = StaticPool
        else:
            # As many connections kept open as Database lets callers use at once: overflow connections
            # beyond a smaller pool were opened and closed again under load, each with a new
            # aiosqlite thread.
            kwargs["pool_size"] = SQLITE_CONNECTIONS
            kwargs["max_overflow"] = 0
        engine = create_async_engine(url, **kwargs)
        event.listen(engine.sync_engine, "connect", lambda c, r: _on_sqlite_connect(c, r, memory=memory))
        event.listen(engine.sync_engine, "begin", _on_sqlite_begin)
        return engine
    if backend == "postgresql":
        # asyncpg prepares every statement; after five runs PostgreSQL may keep a generic plan for
        # good, costed on the table sizes of that moment. Planned on a young store's near-empty tables
        # (sequential scans, hash joins) and never replanned without ANALYZE, those plans made the
        # claim and report paths slow down as the tables grew. A custom plan per execution costs a
        # fraction of a millisecond and follows the tables' current size.
        # asyncpg.connect takes no application_name argument: one in the URL (how an operator tells
        # replicas apart in pg_stat_activity) is a server setting, as libpq makes it.
        name = parsed.query.get("application_name", APPLICATION_NAME)
        server_settings = {
            "plan_cache_mode": "force_custom_plan",
            "application_name": name if isinstance(name, str) else name[-1],
        }
        engine = create_async_engine(
            parsed.difference_update_query(["application_name"]),
            pool_size=pool_size,
            max_overflow=pool_size,
            connect_args={"server_settings": server_settings, "timeout": _PG_CONNECT_TIMEOUT_S},
        )
        event.listen(engine.sync_engine, "checkout", _replace_closed_connection)
        return engine
    raise InvalidArgument(
        f"unsupported database URL {parsed.render_as_string(hide_password=True)!r}: "
        "use sqlite+aiosqlite:///path.db or postgresql+asyncpg://user@host/db"
    )


def _replace_closed_connection(dbapi_connection: Any, _record: Any, _proxy: Any) -> None:
    """Refuses a pooled connection the server closed while it sat idle, so the pool opens a fresh one.

    asyncpg notices the server's goodbye (a restart, ``pg_terminate_backend``) as it arrives, so asking
    costs no round trip, unlike ``pool_pre_ping``'s one per checkout.
    """
    driver_connection = getattr(dbapi_connection, "_connection", None)  # asyncpg's, in SQLAlchemy's adapter
    is_closed = getattr(driver_connection, "is_closed", None)
    if callable(is_closed) and is_closed():
        raise sa.exc.DisconnectionError("the database server closed this pooled connection")


class _CommitInDoubt(Exception):
    """The connection broke while a write transaction committed: it may or may not have committed."""

    def __init__(self, transaction_id: int, result: object) -> None:
        super().__init__(f"the commit of transaction {transaction_id} may not have completed")
        self.transaction_id = transaction_id
        self.result = result


async def _roll_back(transaction: Any) -> None:
    """Rolls back after a failure; on a broken connection the server has rolled back already."""
    with contextlib.suppress(Exception):
        await transaction.rollback()


class Database:
    """An engine plus the transaction discipline of its dialect.

    Args:
        url: The database URL.
        pool_size: PostgreSQL connections kept open.
        retry: How calls retry broken connections (see :mod:`fedlink.server.store.outages`).
    """

    def __init__(self, url: str, *, pool_size: int = 10, retry: StoreRetryPolicy | None = None) -> None:
        self.url = url
        self.engine = create_engine(url, pool_size=pool_size)
        self.dialect_name = self.engine.dialect.name
        self.is_sqlite = self.dialect_name == "sqlite"
        self._memory = is_memory_sqlite(url)
        # SQLite takes one writer at a time anyway; queueing writers here keeps them off the busy
        # handler (which sleeps in a thread). In memory, readers share the one connection too.
        self._write_lock = asyncio.Lock() if self.is_sqlite else None
        self._write_engine = self.engine.execution_options(**{_WRITE_OPTION: True})
        # Built on first use of write_sync: only a SQLite file gets its own writer thread.
        self._sync_writer: tuple[sa.Engine, ThreadPoolExecutor] | None = None
        # Callers queue here for a pooled connection instead of failing with the pool's checkout
        # timeout when thousands of long polls read at once (SQLite file: its whole pool).
        capacity = SQLITE_CONNECTIONS if self.is_sqlite else 2 * pool_size
        self._slots = contextlib.nullcontext() if self._memory else asyncio.Semaphore(capacity)
        self.retry = retry or StoreRetryPolicy()
        #: Whether the store answers (the coordinator's health follows it).
        self.availability = StoreAvailability()
        # Until the database answered once nothing is retried: a wrong URL at start fails at once.
        self._reached = False

    def insert_ignore(self, table: sa.Table) -> Any:
        """``INSERT ... ON CONFLICT DO NOTHING`` into ``table`` for this database's dialect."""
        if self.is_sqlite:
            return sqlite.insert(table).on_conflict_do_nothing()
        return postgresql.insert(table).on_conflict_do_nothing()

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A read-only transaction.

        Opening the connection is retried within the call's budget (nothing has run yet). A connection
        that breaks during the transaction raises :class:`ConnectionLost`: the caller's whole read may
        run again (:meth:`reading`).
        """
        if self._memory:
            assert self._write_lock is not None
            async with self._write_lock, self.engine.begin() as conn:
                yield conn
            return
        budget = _BUDGET.get() or self._budget()
        async with self._slots:
            conn = await self._connect(self.engine, budget)
            try:
                async with conn.begin():
                    yield conn
            except Exception as exc:
                if self._reached and is_connection_loss(exc) and not isinstance(exc, StoreUnavailable):
                    raise ConnectionLost(
                        f"the database connection broke during a read ({type(exc).__name__})",
                        retry_after=self.retry.retry_after,
                    ) from exc
                self._answered()
                raise
            finally:
                await conn.close()
        self._answered()

    async def reading(self, call: Callable[[], Awaitable[T]]) -> T:
        """Runs a read-only ``call`` (a store method that only reads), again on a fresh connection each
        time its connection broke, within one retry budget."""
        budget = self._budget()
        token = _BUDGET.set(budget)
        try:
            while True:
                try:
                    return await call()
                except ConnectionLost as exc:
                    await budget.spend(exc.__cause__ or exc, "reading")
        finally:
            _BUDGET.reset(token)

    async def write(self, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
        """Run ``work`` in one write transaction, applied once.

        Retried whole on deadlock or serialization failure, and on a fresh connection when the
        connection broke before the commit. When it broke during the commit, the transaction's status
        says whether it committed (then its result is returned) or must run again.

        Raises:
            StoreUnavailable: the connection kept breaking for the whole retry budget (if the commit's
                outcome could not be learnt, the work may have been applied: callers' request ids and
                idempotent writes cover that case).
        """
        budget = self._budget()
        contention = 0
        while True:
            try:
                result = await self._write_once(work, budget)
            except _CommitInDoubt as doubt:
                if await self._committed(doubt.transaction_id, doubt.__cause__ or doubt, budget):
                    self._answered()
                    return doubt.result  # type: ignore[return-value]  # what work returned
                await budget.spend(doubt.__cause__ or doubt, "committing a write")
                continue
            except StoreUnavailable:
                raise
            except Exception as exc:
                if self._reached and is_connection_loss(exc):
                    await budget.spend(exc, "writing")
                    continue
                if not isinstance(exc, sa.exc.DBAPIError):
                    self._answered()
                    raise
                contention += 1
                if sqlstate(exc) not in _RETRYABLE_SQLSTATES or contention == _MAX_ATTEMPTS:
                    if isinstance(exc, sa.exc.OperationalError) and "locked" in str(exc):
                        raise Unavailable(f"database is busy: {exc.orig}") from exc
                    raise
                log.debug("retrying a write transaction after %s (attempt %d)", sqlstate(exc), contention)
                await asyncio.sleep(0.001 * contention)
                continue
            self._answered()
            return result

    async def _write_once(self, work: Callable[[AsyncConnection], Awaitable[T]], budget: RetryBudget) -> T:
        async with self._writer_slot():
            conn = await self._connect(self._write_engine, budget)
            try:
                transaction = await conn.begin()
                try:
                    result = await work(conn)
                    transaction_id = None if self.is_sqlite else await conn.scalar(_TRANSACTION_ID)
                except BaseException:
                    await _roll_back(transaction)
                    raise
                try:
                    await transaction.commit()
                except Exception as exc:
                    if not (self._reached and is_connection_loss(exc)):
                        raise
                    if transaction_id is None:
                        return result  # it wrote nothing: there was nothing to lose
                    raise _CommitInDoubt(int(transaction_id), result) from exc
                return result
            finally:
                await conn.close()

    @contextlib.asynccontextmanager
    async def _writer_slot(self) -> AsyncIterator[None]:
        if self._write_lock is not None:
            async with self._write_lock, self._slots:
                yield
        else:
            async with self._slots:
                yield

    async def _connect(self, engine: AsyncEngine, budget: RetryBudget) -> AsyncConnection:
        """A connection of ``engine``, opened again within ``budget`` while the database refuses."""
        while True:
            try:
                return await engine.connect()
            except Exception as exc:
                if not (self._reached and is_connect_failure(exc)):
                    raise
                await budget.spend(exc, "connecting")

    async def _committed(self, transaction_id: int, cause: BaseException, budget: RetryBudget) -> bool:
        """Whether a transaction whose commit was cut off committed, asked on another connection.

        Raises:
            StoreUnavailable: the database did not say within the budget.
        """
        while True:
            try:
                async with self._slots, self.engine.connect() as conn:
                    status = await conn.scalar(_TRANSACTION_STATUS, {"xid": transaction_id})
            except Exception as exc:
                if not is_connect_failure(exc):
                    raise
                await budget.spend(exc, "asking whether a commit went through")
                continue
            if status in ("committed", "aborted"):
                log.info("a write's connection broke during its commit; the transaction had %s", status)
                return bool(status == "committed")
            # "in progress": the broken connection's server process has not finished the commit yet.
            await budget.spend(cause, "waiting for a cut-off commit to finish")

    async def probe(self) -> bool:
        """Tells whether the database answers now (``SELECT 1``); marks the store available if it does."""
        try:
            async with self._slots, self.engine.connect() as conn:
                await conn.execute(sa.text("SELECT 1"))
        except Exception as exc:
            if not is_connect_failure(exc):
                raise
            return False
        self._answered()
        return True

    def _budget(self) -> RetryBudget:
        return RetryBudget(self.retry, self.availability)

    def _answered(self) -> None:
        self._reached = True
        if not self.availability.available:
            self.availability.came_back()

    async def write_sync(self, work: Callable[[sa.Connection], T]) -> T:
        """Run synchronous ``work`` in one write transaction (retried as :meth:`write` retries).

        On a SQLite file the whole transaction runs in the store's writer thread (no thread hop per
        statement); elsewhere inside the async connection's ``run_sync``.
        """
        if not self.is_sqlite or self._memory:
            return await self.write(lambda conn: conn.run_sync(work))
        assert self._write_lock is not None
        engine, thread = self._writer()
        async with self._write_lock:
            # If the caller is cancelled the thread still finishes (commits or rolls back) on its own.
            return await asyncio.get_running_loop().run_in_executor(thread, _in_transaction, engine, work)

    def _writer(self) -> tuple[sa.Engine, ThreadPoolExecutor]:
        if self._sync_writer is None:
            thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedlink-sqlite-writer")
            self._sync_writer = (_sqlite_sync_engine(self.url), thread)
        return self._sync_writer

    async def dispose(self) -> None:
        """Close every pooled connection (and stop the SQLite writer thread)."""
        if self._sync_writer is not None:
            engine, thread = self._sync_writer
            self._sync_writer = None
            await asyncio.get_running_loop().run_in_executor(thread, engine.dispose)
            thread.shutdown(wait=True)
        await self.engine.dispose()


def is_store_outage(exc: BaseException) -> bool:
    """True for an error that says the database could not be reached or used just now (a dropped or
    refused connection, a locked or missing table, a busy database) rather than that the request was
    wrong: trying again later may succeed."""
    if isinstance(exc, Unavailable | OSError | ConnectionError) or is_connection_loss(exc):
        return True
    if isinstance(exc, sa.exc.DBAPIError):
        return bool(exc.connection_invalidated) or isinstance(
            exc, sa.exc.OperationalError | sa.exc.InterfaceError
        )
    return False


def _in_transaction(engine: sa.Engine, work: Callable[[sa.Connection], T]) -> T:
    """Run ``work`` in a transaction of ``engine``; a locked database is Unavailable, as in write()."""
    try:
        with engine.begin() as conn:
            return work(conn)
    except sa.exc.OperationalError as exc:
        if "locked" in str(exc):
            raise Unavailable(f"database is busy: {exc.orig}") from exc
        raise
