"""What a device keeps on disk: its identity (device id + credential) and results not yet acknowledged.

Both live in the runner's state directory, owner-only (0700 directory, 0600 files), written atomically
(temporary file, fsync, rename, fsync of the directory) so a crash or power loss leaves either the old
or the new file, never half of one.

One runner at a time uses a state directory: two would be one device, polling, training and reporting
twice. :meth:`StateDir.lock` takes ``flock`` on ``<state_dir>/lock``, which records the holder's pid;
the kernel releases it when the process ends, however it ends, so a crash never leaves it held.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from fedlink.common.errors import FailedPrecondition, InvalidArgument
from fedlink.common.files import FileLock, LockHeld, fsync_directory

__all__ = ["Identity", "PendingResults", "StateDir", "write_private"]

_log = logging.getLogger(__name__)


def write_private(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically and durably, readable by the owner only."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)  # the rename is durable only once the entry is


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    """The device's identity as the coordinator gave it, or an enrolment in progress."""

    #: The Enroll request id; reusing it after a crash gets the same device back.
    enroll_request_id: str
    device_id: str = ""
    credential: str = ""
    #: The coordinator that issued it (for messages; a device belongs to one coordinator).
    server: str = ""

    @property
    def enrolled(self) -> bool:
        """Whether the coordinator answered the enrolment."""
        return bool(self.device_id and self.credential)


class StateDir:
    """The runner's state directory: ``identity.json`` and ``pending/<request_id>.pb``."""

    def __init__(self, path: Path) -> None:
        """Creates the directory (0700) if needed.

        Raises:
            FailedPrecondition: The path exists but is not a writable directory.
        """
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise FailedPrecondition(f"cannot create the runner state directory {self.path}: {exc}") from None
        if not os.access(self.path, os.W_OK):
            raise FailedPrecondition(f"the runner state directory {self.path} is not writable")
        self.pending = PendingResults(self.path / "pending")

    @property
    def identity_file(self) -> Path:
        """Where the identity is kept."""
        return self.path / "identity.json"

    def lock(self) -> FileLock:
        """Takes the directory for this process, without waiting; release the lock when done with it.

        Raises:
            FailedPrecondition: another process holds it (the message names the directory and the
                holder's pid), or the lock file cannot be created.
        """
        try:
            return FileLock.take(self.path / "lock", str(os.getpid()))
        except LockHeld as held:
            raise FailedPrecondition(
                f"the runner state directory {self.path} is in use by another runner "
                f"(pid {held.record or 'unknown'}): two runners on one state directory would be one "
                "device; stop it, or give this runner its own --state-dir"
            ) from None

    def load_identity(self) -> Identity | None:
        """The stored identity, or None if the device never started enrolling.

        Raises:
            InvalidArgument: The file exists but is not an identity (the message names the file).
        """
        try:
            raw = self.identity_file.read_bytes()
        except FileNotFoundError:
            return None
        try:
            doc = json.loads(raw)
            return Identity(
                enroll_request_id=str(doc["enroll_request_id"]),
                device_id=str(doc.get("device_id", "")),
                credential=str(doc.get("credential", "")),
                server=str(doc.get("server", "")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(
                f"{self.identity_file} is not a fedlink runner identity ({exc}); move it away to enrol anew"
            ) from None

    def save_identity(self, identity: Identity) -> None:
        """Stores the identity (0600)."""
        doc = {
            "enroll_request_id": identity.enroll_request_id,
            "device_id": identity.device_id,
            "credential": identity.credential,
            "server": identity.server,
        }
        write_private(self.identity_file, json.dumps(doc, indent=2).encode())


class PendingResults:
    """Serialized ReportResult requests written before the first attempt, deleted once acknowledged.

    Files are named by request id, so a restarted runner re-sends each with its original id and the
    coordinator answers the original reply instead of storing the result twice. A result too large to
    travel inline keeps its serialized DXO beside the request (``<request_id>.blob``, written first), so
    the request names the blob by hash and the bytes are serialized once. Requests the coordinator
    refused for good are moved to ``rejected/`` for the operator, not retried forever.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _file(self, request_id: str) -> Path:
        if not request_id or "/" in request_id or request_id.startswith("."):
            raise InvalidArgument(f"not a usable request id: {request_id!r}")
        return self.path / f"{request_id}.pb"

    def put(self, request_id: str, data: bytes, *, blob: bytes | None = None) -> None:
        """Keeps a request (and the blob it names) until :meth:`done`, durably, before it is sent."""
        if blob is not None:
            write_private(self._blob_file(request_id), blob)
        write_private(self._file(request_id), data)

    def blob(self, request_id: str) -> bytes | None:
        """The blob kept with a request by :meth:`put`, if any."""
        try:
            return self._blob_file(request_id).read_bytes()
        except FileNotFoundError:
            return None

    def _blob_file(self, request_id: str) -> Path:
        return self._file(request_id).with_suffix(".blob")

    def done(self, request_id: str) -> None:
        """Forgets an acknowledged request."""
        self._file(request_id).unlink(missing_ok=True)
        self._blob_file(request_id).unlink(missing_ok=True)

    def reject(self, request_id: str) -> Path:
        """Moves a request the coordinator refused for good to ``rejected/``; returns its new path."""
        rejected = self.path / "rejected"
        rejected.mkdir(exist_ok=True, mode=0o700)
        target = rejected / f"{request_id}.pb"
        blob = self._blob_file(request_id)
        if blob.exists():
            os.replace(blob, target.with_suffix(".blob"))
        os.replace(self._file(request_id), target)
        return target

    def items(self) -> list[tuple[str, bytes]]:
        """Every pending request as ``(request_id, bytes)``, oldest first.

        A blob whose request was never written (a crash between the two writes) is removed.
        """
        files = sorted(self.path.glob("*.pb"), key=lambda p: (p.stat().st_mtime_ns, p.name))
        kept = {p.stem for p in files}
        for orphan in self.path.glob("*.blob"):
            if orphan.stem not in kept:
                orphan.unlink(missing_ok=True)
        return [(p.stem, p.read_bytes()) for p in files]
