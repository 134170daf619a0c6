"""File-system helpers shared by the runner's state directory and the coordinator's data directory:
durable directory entries, and an exclusive lock that names its holder."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Final

from fedlink.common.errors import FailedPrecondition

__all__ = ["FileLock", "LockHeld", "fsync_directory"]

_MAX_RECORD_BYTES: Final = 4096


def fsync_directory(directory: Path) -> None:
    """Makes the directory's entries (a file created or renamed into it) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LockHeld(FailedPrecondition):
    """Another process holds the lock; ``record`` is what it wrote in the lock file ("" if nothing yet)."""

    def __init__(self, message: str, *, record: str) -> None:
        super().__init__(message)
        self.record = record


class FileLock:
    """An exclusive ``flock`` on a file (0600), held until :meth:`release` or the process's end.

    The kernel releases it when the process exits, even on SIGKILL, so a file left behind by a crash
    never blocks a restart. The file is never removed: removing it would let a newcomer lock a fresh
    file while the holder keeps the old one. The holder writes a short record in it (its pid, say) for
    the message another process gets.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def take(cls, path: Path, record: str) -> FileLock:
        """Takes the lock without waiting and writes ``record`` in the file.

        Raises:
            LockHeld: another process holds it (with what that process recorded).
            FailedPrecondition: the file cannot be created or locked.
        """
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise FailedPrecondition(f"cannot create the lock file {path}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                held = os.pread(fd, _MAX_RECORD_BYTES, 0).decode(errors="replace").strip()
            except OSError:
                held = ""
            os.close(fd)
            raise LockHeld(f"{path} is locked by another process", record=held) from None
        except OSError as exc:
            os.close(fd)
            raise FailedPrecondition(f"cannot lock {path}: {exc.strerror}") from None
        lock = cls(path, fd)
        lock.record(record)
        return lock

    def record(self, text: str) -> None:
        """Rewrites the holder's record (a held lock only)."""
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (text + "\n").encode(), 0)

    def release(self) -> None:
        """Releases the lock; safe to call twice."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor of the open file releases the flock
