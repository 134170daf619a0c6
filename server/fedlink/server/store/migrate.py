"""Schema migrations, run in code: upgrade, downgrade, the current revision, and the check at open.

Alembic runs synchronously; fedlink hands it a connection of the async engine through ``run_sync``,
so no second (sync) driver is needed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.common.errors import SchemaMismatch
from fedlink.server.store.dialect import Database

_log = logging.getLogger(__name__)

SCRIPT_LOCATION = Path(__file__).parent / "migrations"


def _config(connection: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(SCRIPT_LOCATION))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """Return the newest revision this fedlink knows."""
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None
    return head


def known_revisions() -> frozenset[str]:
    """Return every revision id in this fedlink's migration history."""
    script = ScriptDirectory.from_config(_config())
    return frozenset(rev.revision for rev in script.walk_revisions())


def _current(connection: Connection) -> str | None:
    return MigrationContext.configure(connection).get_current_revision()


async def _run(database: Database, action: str, revision: str) -> None:
    def work(sync_conn: Connection) -> None:
        fn: Any = getattr(command, action)
        fn(_config(sync_conn), revision)

    async def in_transaction(conn: AsyncConnection) -> None:
        await conn.run_sync(work)

    await database.write(in_transaction)


async def upgrade(url: str, revision: str = "head") -> None:
    """Upgrade the database at ``url`` to ``revision`` (default: the newest)."""
    database = Database(url)
    try:
        await _run(database, "upgrade", revision)
    finally:
        await database.dispose()


async def downgrade(url: str, revision: str) -> None:
    """Downgrade the database at ``url`` to ``revision`` (``base`` removes every table)."""
    database = Database(url)
    try:
        await _run(database, "downgrade", revision)
    finally:
        await database.dispose()


async def current_revision(url: str) -> str | None:
    """Return the database's revision, or None if it has no fedlink schema yet."""
    database = Database(url)
    try:
        async with database.read() as conn:
            return await conn.run_sync(_current)
    finally:
        await database.dispose()


async def ensure_schema(database: Database, *, auto_migrate: bool) -> None:
    """Check the database's revision is this fedlink's, upgrading it first if ``auto_migrate``.

    Raises:
        SchemaMismatch: the database is newer than this fedlink, or older and ``auto_migrate`` is off.
    """
    async with database.read() as conn:
        current = await conn.run_sync(_current)
    head = head_revision()
    if current == head:
        return
    if current is not None and current not in known_revisions():
        raise SchemaMismatch(
            f"database schema {current} is newer than this fedlink (knows up to {head}): upgrade fedlink"
        )
    if not auto_migrate:
        found = "no fedlink schema" if current is None else f"schema {current}"
        raise SchemaMismatch(
            f"the database has {found}, this fedlink needs {head}: run `fedlink db upgrade --db URL`"
        )
    await _run(database, "upgrade", "head")
    _log.info(f"database schema upgraded from {current or 'none'} to {head}")
