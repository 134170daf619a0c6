"""A SQLite store's files are owner-only: the database holds the cookie-signing key.

A new file is 0600 (and SQLite gives its -wal and -shm files the same mode) whatever the umask; a file
an older version left readable by others is narrowed when the store opens, with a warning.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedlink.server.store import open_store


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def usual_umask() -> Iterator[None]:
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.usefixtures("usual_umask")
async def test_a_new_database_and_its_wal_files_are_0600(tmp_path: Path) -> None:
    path = tmp_path / "new.db"
    async with open_store(f"sqlite+aiosqlite:///{path}", blob_dir=tmp_path / "blobs") as store:
        await store.get_or_create_signing_key()
        files = {e.name: stat.S_IMODE(e.stat().st_mode) for e in os.scandir(tmp_path) if e.is_file()}
    assert files == {"new.db": 0o600, "new.db-wal": 0o600, "new.db-shm": 0o600}


@pytest.mark.usefixtures("usual_umask")
async def test_an_old_database_readable_by_others_is_narrowed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (x)")
    db.close()
    wal = tmp_path / "old.db-wal"
    wal.touch()  # an empty WAL, as a crash can leave one
    for file in (path, wal):
        file.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="fedlink.server.store.dialect"):
        async with open_store(f"sqlite+aiosqlite:///{path}", blob_dir=tmp_path / "blobs"):
            assert (mode(path), mode(wal)) == (0o600, 0o600)
    assert {r.getMessage() for r in caplog.records} == {
        f"{path} was readable by others (mode 0644): made it 0600",
        f"{path}-wal was readable by others (mode 0644): made it 0600",
    }
