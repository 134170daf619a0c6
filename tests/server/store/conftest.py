"""The store contract suite's backends: SQLite in memory, a SQLite file, and PostgreSQL.

PostgreSQL is at ``FEDLINK_TEST_PG_URL`` (default ``postgresql+asyncpg://postgres@127.0.0.1:5432/test``,
the maintenance database). The session creates its own ``fedlink_test_<random>`` database, migrates
it once and drops it at the end; each test starts from empty tables. Without a reachable server the
postgres cases are skipped loudly, or fail when ``CI`` is set.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest

from fedlink.server.domain import ManualClock
from fedlink.server.store import SqlStateStore, create_store, open_store, upgrade
from fedlink.server.store.schema import metadata
from fedlink.server.store.testing import (
    StoreFactory,
    World,
    asyncpg_dsn,
    create_pg_database,
    drop_pg_database,
    make_world,
)

DEFAULT_PG_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
BACKENDS = ["sqlite-memory", "sqlite-file", "postgres"]


def pg_base_url() -> str:
    """The PostgreSQL URL whose server and maintenance database the tests use."""
    return os.environ.get("FEDLINK_TEST_PG_URL", DEFAULT_PG_URL)


def pg_unavailable(reason: str) -> None:
    """Fail (under CI) or skip loudly: the postgres cases could not run."""
    message = f"PostgreSQL at {pg_base_url()} is unreachable ({reason}); the postgres store tests did not run"
    if os.environ.get("CI"):
        pytest.fail(message)
    print(f"\n*** SKIPPING: {message} ***", file=sys.stderr)
    pytest.skip(message)


@pytest.fixture(scope="session")
def pg_session_url() -> Iterator[str | BaseException]:
    """A migrated database for this session, or the error that made one impossible."""
    try:
        url = create_pg_database(pg_base_url())
    except (OSError, asyncpg.PostgresError) as exc:
        yield exc
        return
    try:
        asyncio.run(upgrade(url))
        yield url
    finally:
        drop_pg_database(pg_base_url(), url)


@pytest.fixture
def pg_admin_url(pg_session_url: str | BaseException) -> str:
    """The server's maintenance database URL, for tests that make databases of their own."""
    if isinstance(pg_session_url, BaseException):
        pg_unavailable(repr(pg_session_url))
    return pg_base_url()


@pytest.fixture
def pg_url(pg_session_url: str | BaseException) -> str:
    """The session's PostgreSQL database with every table emptied."""
    if isinstance(pg_session_url, BaseException):
        pg_unavailable(repr(pg_session_url))
    assert isinstance(pg_session_url, str)
    tables = ", ".join(f'"{t.name}"' for t in metadata.sorted_tables)
    dsn = asyncpg_dsn(pg_session_url)

    async def truncate() -> None:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(f"TRUNCATE {tables} CASCADE")
        finally:
            await conn.close()

    asyncio.run(truncate())
    return pg_session_url


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Which database the test runs on."""
    name: str = request.param
    return name


@pytest.fixture
def store_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    """The URL of an empty store on the backend under test."""
    if backend == "sqlite-memory":
        return "sqlite+aiosqlite:///:memory:"
    if backend == "sqlite-file":
        return f"sqlite+aiosqlite:///{tmp_path / 'fedlink.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def clock() -> ManualClock:
    """The store's clock; tests move it by hand."""
    return ManualClock()


@pytest.fixture
async def store(store_url: str, clock: ManualClock, tmp_path: Path) -> AsyncIterator[SqlStateStore]:
    """An open store on the backend under test (migrated on open)."""
    async with open_store(store_url, clock=clock, auto_migrate=True) as opened:
        yield opened


@pytest.fixture
async def more_stores(
    store: SqlStateStore, store_url: str, backend: str, clock: ManualClock
) -> AsyncIterator[StoreFactory]:
    """Open further stores (own engines and connections) on the same database.

    In-memory SQLite has one connection by nature, so there the "other store" is the same one.
    """
    opened: list[SqlStateStore] = []

    async def factory() -> SqlStateStore:
        if backend == "sqlite-memory":
            return store
        other = await _open(store_url, clock)
        opened.append(other)
        return other

    yield factory
    for other in opened:
        await other.close()


async def _open(url: str, clock: ManualClock) -> SqlStateStore:
    return await create_store(url, clock=clock, auto_migrate=False, pool_size=2)


@pytest.fixture
async def world(store: SqlStateStore, clock: ManualClock) -> World:
    """A PENDING job with a run and eight enrolled devices."""
    return await make_world(store, clock)
