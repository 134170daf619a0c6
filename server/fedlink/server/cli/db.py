"""``fedlink db``: upgrade, downgrade and inspect the state store's schema."""

from __future__ import annotations

import asyncio
import os

import click

DEFAULT_DB_URL = "sqlite+aiosqlite:///fedlink.db"


def _url(db: str | None) -> str:
    return db or os.environ.get("FEDLINK_DB_URL") or DEFAULT_DB_URL


@click.group(name="db")
def db_group() -> None:
    """Manage the coordinator's database schema (Alembic migrations)."""


@db_group.command("upgrade")
@click.option("--db", "db", help=f"Database URL (default: $FEDLINK_DB_URL or {DEFAULT_DB_URL}).")
@click.option("--revision", default="head", show_default=True, help="Target revision.")
def upgrade_command(db: str | None, revision: str) -> None:
    """Upgrade the schema to REVISION (the newest by default)."""
    from fedlink.server.store import migrate

    asyncio.run(migrate.upgrade(_url(db), revision))
    click.echo(f"database at revision {asyncio.run(migrate.current_revision(_url(db)))}")


@db_group.command("downgrade")
@click.option("--db", "db", required=True, help="Database URL.")
@click.option("--revision", required=True, help="Target revision (`base` removes every table).")
def downgrade_command(db: str, revision: str) -> None:
    """Downgrade the schema to REVISION."""
    from fedlink.server.store import migrate

    asyncio.run(migrate.downgrade(db, revision))
    click.echo(f"database at revision {asyncio.run(migrate.current_revision(db)) or 'base'}")


@db_group.command("current")
@click.option("--db", "db", help=f"Database URL (default: $FEDLINK_DB_URL or {DEFAULT_DB_URL}).")
def current_command(db: str | None) -> None:
    """Print the database's schema revision and the newest this fedlink knows."""
    from fedlink.server.store import migrate

    current = asyncio.run(migrate.current_revision(_url(db)))
    click.echo(f"current: {current or 'none'}\nhead: {migrate.head_revision()}")
