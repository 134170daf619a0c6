"""The SQL state store: one SQLAlchemy implementation for SQLite and PostgreSQL, and how to open it."""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.server.domain import Clock, SystemClock
from fedlink.server.store.blob_backends import BlobBytes, DatabaseBytes, DirectoryBytes
from fedlink.server.store.blobs import SqlBlobStore
from fedlink.server.store.claims import ClaimQueries
from fedlink.server.store.devices import DeviceQueries
from fedlink.server.store.dialect import Database, is_memory_sqlite
from fedlink.server.store.grants import BlobGrantQueries
from fedlink.server.store.jobs import JobQueries
from fedlink.server.store.migrate import ensure_schema
from fedlink.server.store.outages import StoreRetryPolicy, retry_reads
from fedlink.server.store.results import ResultQueries
from fedlink.server.store.rounds import RoundQueries
from fedlink.server.store.schema import idempotency_records, signing_keys
from fedlink.server.store.stats import StatsQueries

log = logging.getLogger(__name__)

_COOKIE_KEY_ID = "cookie"
SIGNING_KEY_BYTES = 32


# The methods that only read run again, whole, when their connection breaks (writes retry inside
# Database.write): see fedlink.server.store.outages.
@retry_reads(
    "get_job",
    "list_jobs",
    "get_run",
    "get_current_run",
    "list_checkpoints",
    "list_job_events",
    "get_task",
    "list_tasks",
    "has_claimable",
    "has_claimable_many",
    "get_assignment",
    "open_assignments",
    "list_assignments",
    "task_targets",
    "device_may_read_blob",
    "round_summary",
    "result_outlines",
    "round_retries",
    "authenticate_device",
    "authenticate_devices",
    "get_device",
    "list_devices",
    "online_devices",
    "device_holds_blob",
    "count_devices_by_state",
    "count_jobs_by_state",
    "list_results",
    "recall_reply",
)
class SqlStateStore(
    DeviceQueries, JobQueries, ClaimQueries, ResultQueries, BlobGrantQueries, RoundQueries, StatsQueries
):
    """The :class:`~fedlink.server.store.protocol.StateStore` on SQLAlchemy (SQLite or PostgreSQL)."""

    def __init__(self, database: Database, clock: Clock, blob_store: SqlBlobStore) -> None:
        super().__init__(database, clock)
        self._blob_store = blob_store

    @property
    def blobs(self) -> SqlBlobStore:
        """The blob store sharing this state store's database."""
        return self._blob_store

    @property
    def database(self) -> Database:
        """The database this store runs on (for services and tests that need the engine)."""
        return self._db

    async def close(self) -> None:
        """Release the database connections."""
        await self._db.dispose()

    async def get_or_create_signing_key(self) -> bytes:
        """Return the coordinator's 32-byte cookie signing key, creating it once (race-free)."""
        query = sa.select(signing_keys.c.key_bytes).where(signing_keys.c.key_id == _COOKIE_KEY_ID)
        async with self._db.read() as conn:
            key = (await conn.execute(query)).scalar()
        if key is not None:
            return bytes(key)

        async def work(conn: AsyncConnection) -> bytes:
            await conn.execute(
                self._db.insert_ignore(signing_keys).values(
                    key_id=_COOKIE_KEY_ID,
                    key_bytes=secrets.token_bytes(SIGNING_KEY_BYTES),
                    created_at=self._clock.now(),
                )
            )
            # Whoever inserted first wins; everyone reads the winner's key.
            return bytes((await conn.execute(query)).scalar_one())

        return await self._db.write(work)

    async def remember_reply(self, scope: str, request_id: str, reply: bytes) -> bytes:
        """Keep the reply to a mutating request; return the reply kept first if one already was."""

        async def work(conn: AsyncConnection) -> bytes:
            await conn.execute(
                self._db.insert_ignore(idempotency_records).values(
                    scope=scope, request_id=request_id, reply=reply, created_at=self._clock.now()
                )
            )
            return bytes((await conn.execute(_reply_query(scope, request_id))).scalar_one())

        return await self._db.write(work)

    async def recall_reply(self, scope: str, request_id: str) -> bytes | None:
        """Return the reply kept for this request, or None if it was never answered."""
        async with self._db.read() as conn:
            reply = (await conn.execute(_reply_query(scope, request_id))).scalar()
        return None if reply is None else bytes(reply)

    async def forget_replies(self, older_than: datetime) -> int:
        """Drop idempotency records kept before ``older_than``; return how many."""

        async def work(conn: AsyncConnection) -> int:
            statement = sa.delete(idempotency_records).where(idempotency_records.c.created_at < older_than)
            return (await conn.execute(statement)).rowcount

        return await self._db.write(work)


def _reply_query(scope: str, request_id: str) -> sa.Select[Any]:
    return sa.select(idempotency_records.c.reply).where(
        idempotency_records.c.scope == scope, idempotency_records.c.request_id == request_id
    )


def default_blob_dir(url: str) -> Path | None:
    """Where blobs go by default: next to a SQLite file (``<name>.blobs/``); in the database otherwise."""
    if make_url(url).get_backend_name() != "sqlite" or is_memory_sqlite(url):
        return None
    database = make_url(url).database
    assert database is not None
    return Path(database).with_name(Path(database).name + ".blobs")


async def create_store(
    url: str,
    *,
    blob_dir: Path | None = None,
    blobs_in_database: bool = False,
    clock: Clock | None = None,
    auto_migrate: bool | None = None,
    pool_size: int = 10,
    retry: StoreRetryPolicy | None = None,
) -> SqlStateStore:
    """Open the state store at ``url``; the caller must ``await store.close()``.

    Args:
        url: ``sqlite+aiosqlite:///path.db``, ``sqlite+aiosqlite:///:memory:`` or
            ``postgresql+asyncpg://user@host/db``.
        blob_dir: a directory for blob bytes; defaults to ``<sqlite file>.blobs`` next to a SQLite
            file, and to the database itself for PostgreSQL and in-memory SQLite.
        blobs_in_database: keep blob bytes in the database even for a SQLite file.
        clock: the time source (the wall clock by default).
        auto_migrate: upgrade an older schema on open; default True for SQLite, False for
            PostgreSQL (where ``fedlink db upgrade`` is an operator's step).
        pool_size: connections kept open to PostgreSQL.
        retry: how calls ride out broken database connections (see
            :mod:`fedlink.server.store.outages`).

    Raises:
        SchemaMismatch: the schema is newer than this fedlink, or older and not migrated.
    """
    database = Database(url, pool_size=pool_size, retry=retry)
    try:
        await ensure_schema(
            database, auto_migrate=database.is_sqlite if auto_migrate is None else auto_migrate
        )
    except BaseException:
        await database.dispose()
        raise
    directory = None if blobs_in_database else (blob_dir or default_blob_dir(url))
    backend: BlobBytes = (
        DirectoryBytes(directory, database) if directory is not None else DatabaseBytes(database)
    )
    the_clock = clock or SystemClock()
    log.info("state store open", extra={"database": make_url(url).render_as_string(hide_password=True)})
    return SqlStateStore(database, the_clock, SqlBlobStore(database, the_clock, backend))


@contextlib.asynccontextmanager
async def open_store(
    url: str,
    *,
    blob_dir: Path | None = None,
    blobs_in_database: bool = False,
    clock: Clock | None = None,
    auto_migrate: bool | None = None,
    pool_size: int = 10,
    retry: StoreRetryPolicy | None = None,
) -> AsyncIterator[SqlStateStore]:
    """``async with open_store(url) as store:`` — :func:`create_store`, closed on exit."""
    store = await create_store(
        url,
        blob_dir=blob_dir,
        blobs_in_database=blobs_in_database,
        clock=clock,
        auto_migrate=auto_migrate,
        pool_size=pool_size,
        retry=retry,
    )
    try:
        yield store
    finally:
        await store.close()
