"""Migrations go up and down on SQLite and PostgreSQL; a schema of the wrong age is refused on open."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.common.errors import SchemaMismatch
from fedlink.server.cli.db import db_group
from fedlink.server.store import current_revision, downgrade, head_revision, open_store, upgrade
from fedlink.server.store.dialect import Database
from fedlink.server.store.schema import metadata
from fedlink.server.store.testing import create_pg_database, drop_pg_database

EXPECTED_TABLES = {t.name for t in metadata.sorted_tables}


@pytest.fixture(params=["sqlite", "postgres"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database without any table (a fresh one per test, on PostgreSQL too)."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"
        return
    admin: str = request.getfixturevalue("pg_admin_url")
    url = create_pg_database(admin, prefix="fedlink_migrate")
    try:
        yield url
    finally:
        drop_pg_database(admin, url)


async def tables(url: str) -> set[str]:
    database = Database(url)
    try:
        async with database.read() as conn:
            names = await conn.run_sync(lambda c: sa.inspect(c).get_table_names())
        return set(names) - {"alembic_version"}
    finally:
        await database.dispose()


async def test_upgrade_downgrade_upgrade(empty_url: str) -> None:
    assert await current_revision(empty_url) is None
    await upgrade(empty_url)
    assert await current_revision(empty_url) == head_revision()
    assert await tables(empty_url) == EXPECTED_TABLES
    await downgrade(empty_url, "base")
    assert await current_revision(empty_url) is None
    assert await tables(empty_url) == set()
    await upgrade(empty_url, "head")
    assert await tables(empty_url) == EXPECTED_TABLES


async def test_database_newer_than_code_is_refused(empty_url: str) -> None:
    await upgrade(empty_url)
    database = Database(empty_url)

    async def stamp(conn: AsyncConnection) -> None:
        await conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999_from_the_future'"))

    await database.write(stamp)
    await database.dispose()
    with pytest.raises(SchemaMismatch, match=r"newer than this fedlink \(knows up to \w+\): upgrade fedlink"):
        async with open_store(empty_url, auto_migrate=True):
            pass


async def test_older_database_needs_upgrade_unless_auto_migrate(empty_url: str) -> None:
    with pytest.raises(SchemaMismatch, match="fedlink db upgrade"):
        async with open_store(empty_url, auto_migrate=False):
            pass
    async with open_store(empty_url, auto_migrate=True) as store:
        assert len(await store.get_or_create_signing_key()) == 32
    assert await current_revision(empty_url) == head_revision()


def test_db_cli_upgrade_current_downgrade(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}"
    runner = CliRunner()
    done = runner.invoke(db_group, ["upgrade", "--db", url])
    assert done.exit_code == 0, done.output
    assert head_revision() in done.output
    current = runner.invoke(db_group, ["current", "--db", url])
    assert f"current: {head_revision()}" in current.output
    down = runner.invoke(db_group, ["downgrade", "--db", url, "--revision", "base"])
    assert down.exit_code == 0 and "base" in down.output
    assert "current: none" in runner.invoke(db_group, ["current", "--db", url]).output
