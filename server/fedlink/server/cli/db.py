"""``fedlink db``: upgrade, downgrade and inspect the state store's schema.

The database is the one ``fedlink serve`` would use: ``--db`` (or ``$FEDLINK_DB_URL``), else the SQLite
file ``fedlink.db`` in the data directory (``--data-dir``, ``$FEDLINK_DATA_DIR``, or the per-user
default).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import click

from fedlink.server.cli.client import fail
from fedlink.server.settings import default_data_dir

_T = TypeVar("_T")

_DB_HELP = "Database URL (default: $FEDLINK_DB_URL, else the SQLite file fedlink.db in the data directory)."
_DATA_DIR_HELP = "The coordinator's data directory (default: $FEDLINK_DATA_DIR or the per-user one)."


def _url(db: str | None, data_dir: Path | None, *, must_exist: bool) -> str:
    """The database URL; an SQLite file that must already exist is checked here, not created."""
    url = db or os.environ.get("FEDLINK_DB_URL") or ""
    if url and "://" not in url:
        fail(
            f"--db takes a database URL, not a path: sqlite+aiosqlite:///{Path(url).resolve()} for an "
            "SQLite file, or postgresql+asyncpg://USER@HOST/DB"
        )
    if not url:
        folder = data_dir or Path(os.environ.get("FEDLINK_DATA_DIR") or default_data_dir())
        url = f"sqlite+aiosqlite:///{folder / 'fedlink.db'}"
    if url.startswith("sqlite") and ":memory:" not in url:
        path = Path(url.split(":///", 1)[-1])
        if must_exist and not path.is_file():
            fail(f"no database at {path} (give --data-dir or --db; `fedlink db upgrade` creates one)")
        if not path.parent.is_dir():
            fail(f"the directory {path.parent} does not exist (give --data-dir or --db)")
    return url


def _run(step: Callable[[], Coroutine[Any, Any, _T]], url: str) -> _T:
    """Runs one migration step, turning a database that cannot be used into a one-line error."""
    from sqlalchemy import make_url
    from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError

    from fedlink.common.errors import FedlinkError

    try:
        return asyncio.run(step())
    except (ArgumentError, NoSuchModuleError) as exc:
        fail(f"not a usable database URL: {exc}")
    except DBAPIError as exc:
        shown = make_url(url).render_as_string(hide_password=True)
        fail(f"cannot use the database {shown}: {exc.orig if exc.orig is not None else exc}")
    except OSError as exc:  # e.g. PostgreSQL refusing the connection
        fail(f"cannot reach the database {make_url(url).render_as_string(hide_password=True)}: {exc}")
    except FedlinkError as exc:
        fail(exc.message)


def _data_dir_option() -> Callable[[Callable[..., None]], Callable[..., None]]:
    return click.option(
        "--data-dir",
        "data_dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help=_DATA_DIR_HELP,
    )


@click.group(name="db")
def db_group() -> None:
    """Manage the coordinator's database schema (Alembic migrations)."""


@db_group.command("upgrade")
@click.option("--db", "db", help=_DB_HELP)
@_data_dir_option()
@click.option("--revision", default="head", show_default=True, help="Target revision.")
def upgrade_command(db: str | None, data_dir: Path | None, revision: str) -> None:
    """Upgrade the schema to REVISION (the newest by default); creates an SQLite database."""
    from fedlink.server.store import migrate

    url = _url(db, data_dir, must_exist=False)
    _run(lambda: migrate.upgrade(url, revision), url)
    click.echo(f"database at revision {_run(lambda: migrate.current_revision(url), url)}")


@db_group.command("downgrade")
@click.option("--db", "db", help=_DB_HELP)
@_data_dir_option()
@click.option("--revision", required=True, help="Target revision (`base` removes every table).")
def downgrade_command(db: str | None, data_dir: Path | None, revision: str) -> None:
    """Downgrade the schema to REVISION."""
    from fedlink.server.store import migrate

    url = _url(db, data_dir, must_exist=True)
    _run(lambda: migrate.downgrade(url, revision), url)
    click.echo(f"database at revision {_run(lambda: migrate.current_revision(url), url) or 'base'}")


@db_group.command("current")
@click.option("--db", "db", help=_DB_HELP)
@_data_dir_option()
def current_command(db: str | None, data_dir: Path | None) -> None:
    """Print the database's schema revision and the newest this fedlink knows."""
    from fedlink.server.store import migrate

    url = _url(db, data_dir, must_exist=True)
    current = _run(lambda: migrate.current_revision(url), url)
    click.echo(f"current: {current or 'none'}\nhead: {migrate.head_revision()}")
