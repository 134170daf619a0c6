"""One coordinator per data directory: an exclusive lock held for the coordinator's life.

The data directory holds the coordinator's identity (``coordinator-id``, the owner of its run leases),
its SQLite store and its blobs. Two processes on one directory would both own the same runs and
drive the same job (each round got two ``round_started`` events and two results per device), so the
second is refused at start. This holds whatever the database: a second process on the same directory
and a PostgreSQL store would still share the first one's identity. Coordinators that share a
PostgreSQL store each have their own data directory.

The lock is ``flock`` on ``<data_dir>/coordinator.lock`` (0600), which records the holder's pid, host
and address for the message another process gets. The kernel releases it when the process exits,
even on SIGKILL, so a lock file left behind by a crash never blocks a restart. The file itself is
never removed: removing it would let a newcomer lock a fresh file while the holder keeps the old one.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
from pathlib import Path
from typing import Final

from fedlink.common.errors import FailedPrecondition

log = logging.getLogger(__name__)

#: The lock file's name in the data directory.
LOCK_FILE: Final = "coordinator.lock"
_MAX_RECORD_BYTES: Final = 4096


class DataDirInUse(FailedPrecondition):
    """Another process holds the data directory's lock."""


class DataDirLock:
    """The held lock on a data directory; :meth:`release` (or the process's end) lets it go."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, data_dir: Path, *, address: str) -> DataDirLock:
        """Takes the lock without waiting and records this process (pid, host, ``address``) in it.

        Raises:
            DataDirInUse: another process holds it; the message names that process.
            FailedPrecondition: the lock file cannot be created or locked.
        """
        path = data_dir / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise FailedPrecondition(f"cannot create the lock file {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe_holder(fd)
            os.close(fd)
            raise DataDirInUse(
                f"the data directory {data_dir} is in use by another coordinator ({holder}); stop it "
                "first, or give this one its own --data-dir (two coordinators on one directory would "
                "both drive its jobs)"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise FailedPrecondition(f"cannot lock {path}: {exc.strerror}") from None
        lock = cls(path, fd)
        lock.record(address)
        return lock

    def record(self, address: str) -> None:
        """Rewrites the holder's record, e.g. once the server knows the port it was given."""
        if self._fd is None:
            return
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "address": address}
        data = (json.dumps(holder) + "\n").encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        """Releases the lock; safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor of the open file releases the flock


def _describe_holder(fd: int) -> str:
    """What the holder wrote in the lock file, for the refusal's message."""
    try:
        raw = os.pread(fd, _MAX_RECORD_BYTES, 0)
        holder = json.loads(raw)
        pid, host, address = int(holder["pid"]), str(holder["host"]), str(holder["address"])
    except (OSError, ValueError, KeyError, TypeError):
        # The holder took the lock but has not written its record yet (or wrote something else).
        return "a process that has not said which yet"
    where = "" if host == socket.gethostname() else f" on host {host}"
    return f"pid {pid}{where}, listening on {address}"


__all__ = ["LOCK_FILE", "DataDirInUse", "DataDirLock"]
