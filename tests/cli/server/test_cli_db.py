"""``fedlink db``: the database ``fedlink serve`` would use, and one-line errors for one it cannot."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest

from fedlink.server.logs import configure_logging
from fedlink.server.store import create_store, migrate

from .conftest import Cli

HEAD = migrate.head_revision()


def test_the_data_directorys_database_is_found_from_the_flag_or_the_environment(tmp_path: Path) -> None:
    cli = Cli()
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    upgraded = cli("db", "upgrade", "--data-dir", str(data_dir))
    assert upgraded.exit_code == 0, upgraded.output
    assert upgraded.stdout.strip() == f"database at revision {HEAD}"
    assert (data_dir / "fedlink.db").is_file()
    for found in (
        cli("db", "current", "--data-dir", str(data_dir)),
        cli("db", "current", env={"FEDLINK_DATA_DIR": str(data_dir)}),
        cli("db", "current", "--db", f"sqlite+aiosqlite:///{data_dir / 'fedlink.db'}"),
    ):
        assert found.exit_code == 0, found.output
        assert found.stdout == f"current: {HEAD}\nhead: {HEAD}\n"


def test_current_of_a_missing_database_names_it_and_creates_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "empty"
    missing.mkdir()
    result = Cli()("db", "current", "--data-dir", str(missing))
    assert result.exit_code == 2
    assert result.stderr == (
        f"error: no database at {missing / 'fedlink.db'} (give --data-dir or --db; "
        "`fedlink db upgrade` creates one)\n"
    )
    assert list(missing.iterdir()) == []


@pytest.mark.parametrize(
    ("db", "expected"),
    [
        ("fedlink.db", "error: --db takes a database URL, not a path: sqlite+aiosqlite:///"),
        ("postgresql+asyncpg://nobody:s3cret@127.0.0.1:1/x", "error: cannot reach the database "),
        ("mysql+nosuchdriver://x/y", "error: "),
    ],
    ids=["a-path", "unreachable-postgres", "unknown-driver"],
)
def test_a_database_that_cannot_be_used_is_a_one_line_error(db: str, expected: str) -> None:
    result = Cli()("db", "current", "--db", db)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(expected) and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.output and "s3cret" not in result.output


async def test_alembics_info_lines_stay_out_of_the_log_and_fedlink_says_what_it_upgraded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = logging.getLogger()
    level = root.level
    handler = configure_logging("console", "INFO", stream=io.StringIO())
    try:
        assert not logging.getLogger("alembic").isEnabledFor(logging.INFO)
        configure_logging("console", "DEBUG", stream=io.StringIO())
        assert logging.getLogger("alembic").isEnabledFor(logging.DEBUG)  # all of it when debugging
        handler = configure_logging("console", "INFO", stream=io.StringIO())
        with caplog.at_level(logging.INFO, logger="fedlink.server.store.migrate"):
            store = await create_store(
                f"sqlite+aiosqlite:///{tmp_path / 'x.db'}", blob_dir=tmp_path / "blobs", auto_migrate=True
            )
            await store.close()
        said = [
            r.getMessage()
            for r in caplog.records
            if r.name.startswith(("alembic", "fedlink.server.store.migrate"))
        ]
        assert said == [f"database schema upgraded from none to {HEAD}"]
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        logging.getLogger("alembic").setLevel(logging.NOTSET)
