"""One coordinator per data directory: an exclusive lock held for the coordinator's life.

The data directory holds the coordinator's identity (``coordinator-id``, the owner of its run leases),
its SQLite store and its blobs. Two processes on one directory would both own the same runs and
drive the same job (each round got two ``round_started`` events and two results per device), so the
second is refused at start. This holds whatever the database: a second process on the same directory
and a PostgreSQL store would still share the first one's identity. Coordinators that share a
PostgreSQL store each have their own data directory.

The lock is a :class:`~fedlink.common.files.FileLock` on ``<data_dir>/coordinator.lock``, which records
the holder's pid, host and address for the message another process gets. A SQLite store is one
coordinator's too, wherever its file is: coordinators with data directories of their own that name one
SQLite file would share its jobs without sharing their wake-ups, so its file gets a lock of the same
kind beside it (``<file>.coordinator.lock``). Replicas share PostgreSQL, never SQLite.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Final

from fedlink.common.errors import FailedPrecondition
from fedlink.common.files import FileLock, LockHeld

#: The lock file's name in the data directory.
LOCK_FILE: Final = "coordinator.lock"


class DataDirInUse(FailedPrecondition):
    """Another process holds the data directory's lock."""


class DataDirLock:
    """The held lock on a data directory; :meth:`release` (or the process's end) lets it go."""

    def __init__(self, lock: FileLock, database: FileLock | None = None) -> None:
        self._lock = lock
        self._database = database
        self.path = lock.path

    @classmethod
    def acquire(cls, data_dir: Path, *, address: str, sqlite_file: Path | None = None) -> DataDirLock:
        """Takes the lock without waiting and records this process (pid, host, ``address``) in it; with
        ``sqlite_file``, the lock beside that database file too.

        Raises:
            DataDirInUse: another process holds one of them; the message names that process.
            FailedPrecondition: a lock file cannot be created or locked.
        """
        try:
            lock = FileLock.take(data_dir / LOCK_FILE, _record(address))
        except LockHeld as held:
            raise DataDirInUse(
                f"the data directory {data_dir} is in use by another coordinator "
                f"({_describe_holder(held.record)}); stop it first, or give this one its own --data-dir "
                "(two coordinators on one directory would both drive its jobs)"
            ) from None
        if sqlite_file is None:
            return cls(lock)
        try:
            database = FileLock.take(
                sqlite_file.with_name(f"{sqlite_file.name}.coordinator.lock"), _record(address)
            )
        except LockHeld as held:
            lock.release()
            raise DataDirInUse(
                f"the SQLite database {sqlite_file} is in use by another coordinator "
                f"({_describe_holder(held.record)}); a SQLite store serves one coordinator: give this one "
                "its own database, or run replicas on one PostgreSQL database (--db-url postgresql+asyncpg://...)"
            ) from None
        except BaseException:
            lock.release()
            raise
        return cls(lock, database)

    def record(self, address: str) -> None:
        """Rewrites the holders' records, e.g. once the server knows the port it was given."""
        self._lock.record(_record(address))
        if self._database is not None:
            self._database.record(_record(address))

    def release(self) -> None:
        """Releases the locks; safe to call twice."""
        if self._database is not None:
            self._database.release()
        self._lock.release()


def _record(address: str) -> str:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "address": address})


def _describe_holder(record: str) -> str:
    """What the holder wrote in the lock file, for the refusal's message."""
    try:
        holder = json.loads(record)
        pid, host, address = int(holder["pid"]), str(holder["host"]), str(holder["address"])
    except (ValueError, KeyError, TypeError):
        # The holder took the lock but has not written its record yet (or wrote something else).
        return "a process that has not said which yet"
    where = "" if host == socket.gethostname() else f" on host {host}"
    return f"pid {pid}{where}, listening on {address}"


__all__ = ["LOCK_FILE", "DataDirInUse", "DataDirLock"]
