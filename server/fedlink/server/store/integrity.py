"""Blob integrity: stored bytes are checked against their sha256 before this process hands them out.

A blob's name is the sha256 of its bytes, so a file overwritten in place, a truncated file or a chunk
row changed behind the store's back is recognisable, but only by hashing the bytes again. The blob
store hashes a blob the first time this process reads it (a stream is hashed whole before its first
chunk goes out, so no caller ever gets bad bytes); a blob once found good is remembered (the newest
:data:`REMEMBERED_BLOBS`), so the devices downloading a round's model cost one hash, not one each.

A blob found bad raises :class:`~fedlink.common.errors.DataLoss` naming it, is logged at ERROR once,
and is remembered as bad for :data:`RECHECK_AFTER_SECONDS`: the readers that come meanwhile (every
device of a round) get the same error without hashing it again or flooding the log, and a blob
restored from a backup is believed again after that.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection
from typing import NoReturn

from fedlink.common.errors import DataLoss

log = logging.getLogger(__name__)

#: Blobs found good that are remembered (least recently read out first): ~200 bytes each.
REMEMBERED_BLOBS = 16_384
#: How long a blob found bad stays known as bad before its bytes are hashed again.
RECHECK_AFTER_SECONDS = 60.0
#: Bytes hashed in a worker thread rather than on the event loop (hashlib releases the GIL).
_THREAD_HASH_BYTES = 1024 * 1024

#: Told ``(sha256, message)`` when a blob is found corrupted (once per detection, as it is logged).
CorruptionListener = Callable[[str, str], None]


async def sha256_hex(data: bytes) -> str:
    """The hex sha256 of ``data``; a large one is hashed off the event loop."""
    if len(data) >= _THREAD_HASH_BYTES:
        return await asyncio.to_thread(lambda: hashlib.sha256(data).hexdigest())
    return hashlib.sha256(data).hexdigest()


class BlobIntegrity:
    """Which blobs this process found good or bad, and what a bad one raises."""

    def __init__(
        self,
        *,
        remembered: int = REMEMBERED_BLOBS,
        recheck_after_seconds: float = RECHECK_AFTER_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._good: OrderedDict[str, None] = OrderedDict()
        self._bad: dict[str, tuple[float, str]] = {}
        self._running: dict[str, asyncio.Future[None]] = {}
        self._remembered = remembered
        self._recheck = recheck_after_seconds
        self._monotonic = monotonic
        #: Told of each corrupted blob found (e.g. to fail the jobs that use it).
        self.listeners: list[CorruptionListener] = []

    def known_good(self, sha256: str) -> bool:
        """Whether the blob was found good already (it then counts as read just now)."""
        if sha256 in self._good:
            self._good.move_to_end(sha256)
            return True
        return False

    def raise_if_known_bad(self, sha256: str) -> None:
        """Raises the blob's DataLoss again if it was found bad within the recheck time."""
        known = self._bad.get(sha256)
        if known is not None:
            if self._monotonic() - known[0] < self._recheck:
                raise DataLoss(known[1])
            del self._bad[sha256]

    async def check(self, sha256: str, verify: Callable[[], Awaitable[None]]) -> None:
        """Runs ``verify`` (which hashes the blob and calls :meth:`judge`) unless the blob is known good
        or bad already; concurrent callers share one run.

        The run happens in the first caller's own task (never a detached one, which could outlive the
        store); if that caller is cancelled, a waiting one runs it instead.
        """
        while True:
            if self.known_good(sha256):
                return
            self.raise_if_known_bad(sha256)
            running = self._running.get(sha256)
            if running is None:
                break
            try:
                await asyncio.shield(running)
                return
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if running.cancelled() and (task is None or not task.cancelling()):
                    continue  # the first caller was cancelled, not this one: run it here
                raise
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._running[sha256] = future
        try:
            await verify()
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()
            else:
                future.set_exception(exc)
                future.exception()  # retrieved: the waiters, if any, raise it themselves
            raise
        else:
            future.set_result(None)
        finally:
            if self._running.get(sha256) is future:
                del self._running[sha256]

    def judge(self, sha256: str, size_bytes: int, actual_sha256: str, actual_size: int) -> None:
        """Records the blob as good if its bytes are what its row says; raises DataLoss otherwise."""
        if actual_size != size_bytes:
            self.corrupted(
                sha256,
                f"it holds {actual_size} bytes, not the {size_bytes} stored for it "
                f"({'truncated' if actual_size < size_bytes else 'bytes added'})",
            )
        if actual_sha256 != sha256:
            self.corrupted(sha256, f"its {actual_size} bytes hash to {actual_sha256}")
        self._good[sha256] = None
        self._good.move_to_end(sha256)
        while len(self._good) > self._remembered:
            self._good.popitem(last=False)

    def corrupted(self, sha256: str, detail: str) -> NoReturn:
        """Logs the corrupted blob at ERROR, tells the listeners and raises its DataLoss."""
        message = (
            f"blob {sha256} is corrupted: {detail}, so it no longer matches its sha256; it is not used. "
            "Restore the blob from a backup, or delete the jobs that use it"
        )
        self._bad[sha256] = (self._monotonic(), message)
        self._good.pop(sha256, None)
        log.error("blob %s is corrupted: %s", sha256, detail, extra={"blob_sha256": sha256})
        for listener in self.listeners:
            try:
                listener(sha256, message)
            except Exception:  # a listener's bug must not turn the DataLoss into another error
                log.exception("a corruption listener failed for blob %s", sha256)
        raise DataLoss(message)

    def forget(self, sha256s: Collection[str]) -> None:
        """Forgets deleted blobs: stored again, they are checked again."""
        for sha in sha256s:
            self._good.pop(sha, None)
            self._bad.pop(sha, None)
