"""The content-addressed blob store: metadata in the database, bytes in a :mod:`blob_backends` backend.

* Reads are checked: a blob's bytes are hashed against its sha256 before this process first hands
  them out, and a blob that no longer matches raises DataLoss naming it (:mod:`integrity`).
* A blob's ``created_at`` is when it was last stored: storing the same content again (a report's
  payload, an upload, ``put_bytes``, a job submitted on it) moves it to now, in the transaction that
  goes on to use it. :meth:`SqlBlobStore.collect` deletes only blobs unused since before a cutoff
  *and* created before it, so a blob being put to use is never collected under its user.
* Uploads are keyed as :mod:`blob_refs` says; a device's complete upload it has not used yet stays
  marked (``uh-`` keys) and counts against its upload quota until it reports the blob or the marker
  is collected.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Sequence
from contextlib import aclosing
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from fedlink.server.domain import Blob, Clock, new_id
from fedlink.server.store.blob_backends import BlobBytes
from fedlink.server.store.blob_refs import (
    held_key,
    held_keys,
    is_held_key,
    owned_keys,
    referenced_among,
    upload_key,
)
from fedlink.server.store.dialect import Database
from fedlink.server.store.integrity import BlobIntegrity, sha256_hex
from fedlink.server.store.outages import retry_reads
from fedlink.server.store.protocol import (
    CHUNK_SIZE,
    READ_BATCH_BYTES,
    BlobRef,
    CollectedBlobs,
    UploadQuota,
)
from fedlink.server.store.schema import blob_chunks, blob_uploads, blobs

_SHA256 = re.compile(r"[0-9a-f]{64}")
# Hashes per IN list.
_IN_LIST = 500
#: How often a collection looks at every blob, not only those that became old since the last one.
FULL_SWEEP_EVERY = timedelta(hours=24)
#: Bytes of a read batch hashed in a worker thread rather than on the event loop.
_THREAD_HASH_BYTES = 1024 * 1024
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def _check_sha(sha256: str) -> str:
    if not _SHA256.fullmatch(sha256):
        raise InvalidArgument(f"{sha256!r} is not a lowercase hex sha256")
    return sha256


def _upload_key(sha256: str, owner: str | None = None) -> str:
    # Each owner's upload of the content is its own (resumed by it alone), under a key that names the
    # owner (for its quota) and that nobody can announce as a sha256 of theirs.
    return upload_key(sha256, owner)


def _pg_lock_key(owner: str) -> int:
    digest = hashlib.sha256(b"fedlink uploads\0" + owner.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _whole_blobs(sha256s: Sequence[str]) -> sa.Select[Any]:
    """(sha256, size_bytes, data) of those of ``sha256s`` whose bytes are one ``blob_chunks`` row."""
    return (
        sa.select(blobs.c.sha256, blobs.c.size_bytes, blob_chunks.c.data)
        .join(blob_chunks, blob_chunks.c.blob_key == blobs.c.sha256)
        .where(
            blobs.c.sha256.in_(list(dict.fromkeys(sha256s))),
            blob_chunks.c.offset == 0,
            blob_chunks.c.size == blobs.c.size_bytes,
        )
    )


def _touch(now: datetime) -> sa.Update:
    """Marks the blobs bound as ``sha256s`` stored at ``now`` (returning those that are stored)."""
    return (
        sa.update(blobs)
        .where(blobs.c.sha256.in_(sa.bindparam("sha256s", expanding=True)))
        .values(created_at=now)
        .returning(blobs.c.sha256)
    )


# Reads run again, whole, when their connection breaks (see fedlink.server.store.outages).
@retry_reads("exists", "stat", "received_bytes", "read")
class SqlBlobStore:
    """Blobs keyed by sha256: stored once per content, uploaded resumably, read as a stream."""

    def __init__(
        self, database: Database, clock: Clock, backend: BlobBytes, *, integrity: BlobIntegrity | None = None
    ) -> None:
        self._db = database
        self._clock = clock
        self._bytes = backend
        #: Which blobs this process found good or bad (add a listener to hear of corrupted ones).
        self.integrity = integrity or BlobIntegrity()
        # The cutoff of the last collection, and when it last looked at every blob.
        self._swept_until: datetime | None = None
        self._full_sweep_at: datetime | None = None

    async def _blob_row(self, conn: AsyncConnection, sha256: str) -> sa.Row[Any, Any, Any] | None:
        query = sa.select(blobs.c.sha256, blobs.c.size_bytes, blobs.c.created_at).where(
            blobs.c.sha256 == sha256
        )
        return (await conn.execute(query)).first()

    async def exists(self, sha256: str) -> bool:
        """Tell whether a committed blob with this hash is stored."""
        async with self._db.read() as conn:
            return await self._blob_row(conn, sha256) is not None

    async def stat(self, sha256: str) -> Blob:
        """Return a stored blob's metadata; NotFound if it is not stored."""
        async with self._db.read() as conn:
            row = await self._blob_row(conn, sha256)
        if row is None:
            raise NotFound(f"blob {sha256} does not exist")
        return Blob(sha256=row.sha256, size_bytes=row.size_bytes, created_at=row.created_at)

    async def touch(self, sha256: str) -> bool:
        """Tell whether the blob is stored; if it is, it counts as stored just now (not collected yet)."""

        async def work(conn: AsyncConnection) -> bool:
            touched = await conn.execute(_touch(self._clock.now()), {"sha256s": [sha256]})
            return bool(touched.all())

        return await self._db.write(work)

    async def _publish(self, key: str, sha256: str, size: int, owner: str | None = None) -> BlobRef:
        """Turn the finished upload under ``key`` into blob ``sha256`` (or drop it if stored already).

        An owner's upload stays marked as held and unused (its ``uh-`` key) until the owner reports it.
        """
        await self._bytes.sync(key)  # durable before the row that names it commits
        now = self._clock.now()
        row = {"sha256": sha256, "size_bytes": size, "created_at": now}

        async def work(conn: AsyncConnection) -> bool:
            inserted = bool((await conn.execute(self._db.insert_ignore(blobs).values(row))).rowcount)
            if not inserted and not (await conn.execute(_touch(now), {"sha256s": [sha256]})).all():
                # Collected between the two statements: stored again, from this upload.
                inserted = bool((await conn.execute(self._db.insert_ignore(blobs).values(row))).rowcount)
            where = blob_uploads.c.upload_key == key
            if owner is None:
                await conn.execute(sa.delete(blob_uploads).where(where))
            else:
                held = held_key(sha256, owner)
                await conn.execute(sa.delete(blob_uploads).where(blob_uploads.c.upload_key == held))
                await conn.execute(
                    sa.update(blob_uploads)
                    .where(where)
                    .values(upload_key=held, received_bytes=size, created_at=now)
                )
            if inserted:
                await self._bytes.rename(conn, key, sha256)
            return inserted

        if not await self._db.write(work):
            await self._remove_bytes([key])
        return BlobRef(sha256=sha256, size_bytes=size)

    async def _remove_bytes(self, keys: Collection[str]) -> None:
        if keys:

            async def work(conn: AsyncConnection) -> None:
                await self._bytes.remove(conn, keys)

            await self._db.write(work)

    async def put_bytes(self, data: bytes) -> BlobRef:
        """Store ``data`` (once per content) and return its reference."""
        if self._bytes.in_rows(len(data)):
            return (await self.put_many([data]))[0]
        sha256 = hashlib.sha256(data).hexdigest()
        if await self.touch(sha256):
            return BlobRef(sha256=sha256, size_bytes=len(data))
        key = f"put-{new_id()}"

        async def work(conn: AsyncConnection) -> None:
            await self._bytes.write(conn, key, 0, data)

        await self._db.write(work)
        return await self._publish(key, sha256, len(data))

    async def put_many(
        self, datas: Sequence[bytes], *, sha256s: Sequence[str] | None = None
    ) -> list[BlobRef]:
        """Store many small byte strings (once per content) with one transaction; refs in order.

        For the hot path of results: a batch of reports costs one write transaction for all of
        their payloads (one set-based INSERT of the blob rows, one of the bytes kept as rows), not
        several per payload. Bytes the backend keeps outside the database are written (and made
        durable) before that transaction. ``sha256s``: the hashes of ``datas``, when the caller computed
        them already (the device protocol does, to validate and identify a report).
        """
        refs, write = await self.prepare_many(datas, sha256s=sha256s)
        if write is not None:
            await self._db.write_sync(write)
        return refs

    async def prepare_many(
        self, datas: Sequence[bytes], *, sha256s: Sequence[str] | None = None
    ) -> tuple[list[BlobRef], Callable[[sa.Connection], set[str]] | None]:
        """:meth:`put_many` up to its transaction: the refs, and the work to run in a write transaction.

        Bytes kept outside the database are written and durable when this returns; the returned work
        inserts the blob rows (and the bytes kept as rows), so a caller can commit the blobs with its
        own rows in one transaction (the report batches of ``record_results``). The work returns the
        hashes of the blobs it stored anew (the others were stored already, and count as stored now).
        It is None when there is nothing to store.
        """
        if sha256s is None:
            sha256s = [hashlib.sha256(d).hexdigest() for d in datas]
        refs = [BlobRef(sha256=sha, size_bytes=len(d)) for sha, d in zip(sha256s, datas, strict=True)]
        wanted = {ref.sha256: data for ref, data in zip(refs, datas, strict=True)}
        outside = [sha for sha, data in wanted.items() if not self._bytes.in_rows(len(data))]
        if outside:
            # Files are written only for blobs not stored yet; a blob already stored is left alone.
            async with self._db.read() as conn:
                query = sa.select(blobs.c.sha256).where(blobs.c.sha256.in_(outside))
                present = set((await conn.execute(query)).scalars())
            await self._bytes.prepare_objects([(sha, wanted[sha]) for sha in outside if sha not in present])
        now = self._clock.now()
        rows = [{"sha256": sha, "size_bytes": len(data), "created_at": now} for sha, data in wanted.items()]
        insert = self._db.insert_ignore(blobs).returning(blobs.c.sha256)
        touch = _touch(now)

        if not rows:
            return refs, None

        def write(conn: sa.Connection) -> set[str]:
            # Only the rows this transaction inserted are new; a blob stored already (by a concurrent
            # writer too) is marked stored now, so no collection takes it from this batch's users.
            fresh = set(conn.execute(insert, rows).scalars())
            if stored := [sha for sha in wanted if sha not in fresh]:
                gone = set(stored) - set(conn.execute(touch, {"sha256s": stored}).scalars())
                if gone:  # collected between the two statements: stored again
                    fresh.update(conn.execute(insert, [r for r in rows if r["sha256"] in gone]).scalars())
            # The bytes of the blobs this transaction stored (a blob stored already keeps its own).
            self._bytes.insert_objects(conn, [(sha, wanted[sha]) for sha in fresh])
            return fresh

        return refs, write

    async def put_stream(self, chunks: AsyncIterator[bytes]) -> BlobRef:
        """Store a stream of unknown hash chunk by chunk and return its reference."""
        key = f"stream-{new_id()}"
        digest = hashlib.sha256()
        size = 0
        await self._insert_upload(key, None, None)
        try:
            async for chunk in chunks:
                digest.update(chunk)
                offset = size

                async def work(conn: AsyncConnection, offset: int = offset, chunk: bytes = chunk) -> None:
                    await self._bytes.write(conn, key, offset, chunk)

                await self._db.write(work)
                size += len(chunk)
        except BaseException:
            await self._discard(key)
            raise
        return await self._publish(key, digest.hexdigest(), size)

    def _upload_row(self, key: str, sha256: str | None, size_bytes: int | None) -> dict[str, object]:
        return {
            "upload_key": key,
            "sha256": sha256,
            "size_bytes": size_bytes,
            "received_bytes": 0,
            "created_at": self._clock.now(),
        }

    async def _insert_upload(self, key: str, sha256: str | None, size_bytes: int | None) -> None:
        async def work(conn: AsyncConnection) -> None:
            await conn.execute(
                self._db.insert_ignore(blob_uploads).values(self._upload_row(key, sha256, size_bytes))
            )

        await self._db.write(work)

    async def _insert_owned_upload(
        self, key: str, sha256: str, size_bytes: int, owner: str, quota: UploadQuota
    ) -> None:
        """Starts the owner's upload unless it would take the owner's unused uploads over its quota (an
        upload begun already is resumed, whatever the quota says now)."""

        async def work(conn: AsyncConnection) -> None:
            where = blob_uploads.c.upload_key == key
            if (await conn.execute(sa.select(blob_uploads.c.upload_key).where(where))).first():
                return
            if not self._db.is_sqlite:  # the owner's uploads begin one at a time (SQLite: one writer)
                await conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_pg_lock_key(owner))))
            used = (
                await conn.execute(
                    sa.select(sa.func.coalesce(sa.func.sum(blob_uploads.c.size_bytes), 0)).where(
                        owned_keys(blob_uploads.c.upload_key, owner)
                    )
                )
            ).scalar_one()
            if used + size_bytes > quota.max_bytes:
                raise ResourceExhausted(
                    f"device {owner} holds {used} bytes of uploads it has not used (partial ones, and "
                    f"complete ones it did not report); this upload of {size_bytes} bytes would take it over "
                    f"its quota of {quota.max_bytes} bytes. Report or finish the uploads it has: the ones "
                    "it does not use are collected after a while",
                    retry_after=quota.retry_after,
                )
            await conn.execute(
                self._db.insert_ignore(blob_uploads).values(self._upload_row(key, sha256, size_bytes))
            )

        await self._db.write(work)

    async def _discard(self, key: str) -> None:
        async def work(conn: AsyncConnection) -> None:
            await conn.execute(sa.delete(blob_uploads).where(blob_uploads.c.upload_key == key))
            await self._bytes.remove(conn, [key])

        await self._db.write(work)

    async def begin_upload(
        self, sha256: str, size_bytes: int, *, owner: str | None = None, quota: UploadQuota | None = None
    ) -> int:
        """Start (or resume) an upload of a blob with a known hash; return the bytes received so far.

        With an ``owner`` the upload is that owner's own, and goes on even if the blob is stored:
        its bytes prove the owner holds them (see :meth:`commit_upload`). With a ``quota`` too, a new
        upload is refused (ResourceExhausted) if the owner's uploads in flight and complete ones it
        has not used (reported) yet would come to more than ``quota.max_bytes`` with it.
        """
        _check_sha(sha256)
        if size_bytes < 0:
            raise InvalidArgument(f"size_bytes must be >= 0, got {size_bytes}")
        key = _upload_key(sha256, owner)
        if owner is not None and quota is not None:
            await self._insert_owned_upload(key, sha256, size_bytes, owner, quota)
        else:
            await self._insert_upload(key, sha256, size_bytes)
        async with self._db.read() as conn:
            blob = await self._blob_row(conn, sha256)
            upload = (
                await conn.execute(sa.select(blob_uploads).where(blob_uploads.c.upload_key == key))
            ).first()
        if blob is not None and owner is None:
            return int(blob.size_bytes)
        if upload is None:
            raise FailedPrecondition(f"the upload of {sha256} was discarded meanwhile; begin again")
        if upload.size_bytes != size_bytes:
            raise InvalidArgument(
                f"blob {sha256} is being uploaded with size {upload.size_bytes}, not {size_bytes}"
            )
        return int(upload.received_bytes)

    async def received_bytes(self, sha256: str, *, owner: str | None = None) -> int:
        """Return how many bytes of ``sha256`` the store holds (its size once committed).

        With an ``owner``: how many bytes of that owner's own upload arrived, whether or not the blob
        is stored.
        """
        async with self._db.read() as conn:
            blob = None if owner is not None else await self._blob_row(conn, sha256)
            if blob is not None:
                return int(blob.size_bytes)
            received = (
                await conn.execute(
                    sa.select(blob_uploads.c.received_bytes).where(
                        blob_uploads.c.upload_key == _upload_key(sha256, owner)
                    )
                )
            ).scalar()
        return int(received or 0)

    async def append_upload(self, sha256: str, offset: int, data: bytes, *, owner: str | None = None) -> int:
        """Add ``data`` at ``offset`` (which must equal the bytes received); return the new total.

        The upload's ``created_at`` moves to now: a partial upload is stale once idle, however long a
        slow one has been going on.
        """
        key = _upload_key(_check_sha(sha256), owner)

        async def work(conn: AsyncConnection) -> int:
            where = blob_uploads.c.upload_key == key
            upload = (await conn.execute(sa.select(blob_uploads).where(where))).first()
            if upload is None:
                raise FailedPrecondition(f"no upload of {sha256} is in progress: begin it first")
            if offset != upload.received_bytes:
                raise FailedPrecondition(
                    f"upload of {sha256} has {upload.received_bytes} bytes: append there, not at {offset}"
                )
            total = offset + len(data)
            if total > upload.size_bytes:
                raise InvalidArgument(
                    f"upload of {sha256} would exceed its announced {upload.size_bytes} bytes"
                )
            # The received count only moves if nobody appended meanwhile; the bytes follow it.
            moved = await conn.execute(
                sa.update(blob_uploads)
                .where(where, blob_uploads.c.received_bytes == offset)
                .values(received_bytes=total, created_at=self._clock.now())
            )
            if moved.rowcount != 1:
                raise FailedPrecondition(f"upload of {sha256} moved on concurrently; ask for received bytes")
            await self._bytes.write(conn, key, offset, data)
            return total

        return await self._db.write(work)

    async def commit_upload(self, sha256: str, *, owner: str | None = None) -> BlobRef:
        """Check the uploaded bytes hash to ``sha256`` and make the blob readable.

        An ``owner``'s upload is checked even if the blob is stored already (the stored bytes are
        kept, the upload's dropped): it is how the owner proves it holds them.

        Raises:
            FailedPrecondition: the upload is missing or incomplete.
            InvalidArgument: the bytes do not hash to ``sha256``; the upload is discarded.
        """
        key = _upload_key(_check_sha(sha256), owner)
        async with self._db.read() as conn:
            blob = await self._blob_row(conn, sha256)
            upload = (
                await conn.execute(sa.select(blob_uploads).where(blob_uploads.c.upload_key == key))
            ).first()
        if blob is not None and owner is None:
            return BlobRef(sha256=sha256, size_bytes=int(blob.size_bytes))
        if upload is None:
            raise FailedPrecondition(f"no upload of {sha256} is in progress")
        if upload.received_bytes != upload.size_bytes:
            raise FailedPrecondition(
                f"upload of {sha256} has {upload.received_bytes} of {upload.size_bytes} bytes"
            )
        actual, size = await self._bytes.digest(key)
        if actual != sha256 or size != upload.size_bytes:
            await self._discard(key)
            raise InvalidArgument(f"the uploaded bytes hash to {actual}, not {sha256}: upload discarded")
        return await self._publish(key, sha256, size, owner)

    # ---- reads, checked against the sha256 ----
    async def _check(self, sha256: str, size_bytes: int) -> None:
        """Makes sure the stored bytes of ``sha256`` are its own before any is handed out (hashed once
        per process; concurrent readers share one hashing). DataLoss if they are not."""
        await self.integrity.check(sha256, functools.partial(self._hash_stored, sha256, size_bytes))

    async def _hash_stored(self, sha256: str, size_bytes: int) -> None:
        if size_bytes == 0:  # an empty blob keeps no bytes anywhere (no chunk, no file)
            self.integrity.judge(sha256, 0, _EMPTY_SHA256, 0)
            return
        try:
            actual, actual_size = await self._bytes.digest(sha256)
        except FileNotFoundError:
            self.integrity.corrupted(sha256, "its bytes are missing")
        self.integrity.judge(sha256, size_bytes, actual, actual_size)

    async def _check_data(self, sha256: str, size_bytes: int, data: bytes) -> None:
        """Makes sure ``data``, read whole, is blob ``sha256``; DataLoss if it is not."""
        if not self.integrity.known_good(sha256):
            self.integrity.raise_if_known_bad(sha256)
            self.integrity.judge(sha256, size_bytes, await sha256_hex(data), len(data))

    async def iter_chunks(
        self, sha256: str, offset: int = 0, chunk_size: int = CHUNK_SIZE
    ) -> AsyncGenerator[bytes, None]:
        """Yield the blob's bytes from ``offset`` in chunks of at most ``chunk_size`` bytes.

        The blob is checked against its sha256 before the first chunk (see :mod:`integrity`).
        """
        blob = await self.stat(sha256)
        if not 0 <= offset <= blob.size_bytes:
            raise InvalidArgument(f"offset {offset} is outside blob {sha256} of {blob.size_bytes} bytes")
        if chunk_size < 1:
            raise InvalidArgument(f"chunk_size must be >= 1, got {chunk_size}")
        await self._check(sha256, blob.size_bytes)
        if offset == blob.size_bytes:
            return
        async with aclosing(self._bytes.read(sha256, offset, chunk_size)) as chunks:  # its file, at once
            async for chunk in chunks:
                yield chunk

    async def read(self, sha256: str, offset: int = 0, size: int | None = None) -> bytes:
        """Return ``size`` bytes from ``offset`` (to the end if None): for small blobs and ranges.

        Checked against the blob's sha256 (see :mod:`integrity`): a whole blob read for the first
        time is hashed as it is, in one pass.
        """
        if offset == 0 and size is None:
            # A blob kept as one row comes with its metadata in one query.
            async with self._db.read() as conn:
                row = (await conn.execute(_whole_blobs([sha256]))).first()
            if row is not None:
                data = bytes(row.data)
                await self._check_data(sha256, row.size_bytes, data)
                return data
            blob = await self.stat(sha256)
            if not blob.size_bytes:
                await self._check(sha256, 0)
                return b""
            self.integrity.raise_if_known_bad(sha256)
            try:
                async with aclosing(self._bytes.read(sha256, 0, CHUNK_SIZE)) as chunks:
                    data = b"".join([chunk async for chunk in chunks])
            except FileNotFoundError:
                self.integrity.corrupted(sha256, "its bytes are missing")
            await self._check_data(sha256, blob.size_bytes, data)  # hashed unless known good
            return data
        parts: list[bytes] = []
        remaining = size
        async with aclosing(self.iter_chunks(sha256, offset)) as chunks:  # closed at the break too
            async for chunk in chunks:
                if remaining is not None:
                    chunk = chunk[:remaining]
                    remaining -= len(chunk)
                parts.append(chunk)
                if remaining == 0:
                    break
        return b"".join(parts)

    async def read_each(
        self, sha256s: Sequence[str], *, batch_bytes: int = READ_BATCH_BYTES
    ) -> AsyncIterator[bytes]:
        """Yield the bytes of each of ``sha256s``, in order (a hash may repeat).

        Consecutive blobs kept as single rows are fetched together, one query per ``batch_bytes``
        of them; any other blob is read whole on its own. The next batch is fetched while the
        caller works on this one, so memory holds about two batches (or two large blobs).

        Raises:
            NotFound: when the iteration reaches a hash that is not stored.
        """
        sizes: dict[str, int] = {}
        unique = list(dict.fromkeys(sha256s))
        for start in range(0, len(unique), _IN_LIST):
            query = sa.select(blobs.c.sha256, blobs.c.size_bytes).where(
                blobs.c.sha256.in_(unique[start : start + _IN_LIST])
            )
            async with self._db.read() as conn:
                sizes.update((row.sha256, row.size_bytes) for row in await conn.execute(query))
        batches: list[list[str]] = []
        room = -1  # bytes the last batch may still take; -1 once it is closed
        for sha in sha256s:
            size = sizes.get(sha)
            if size is None or not self._bytes.in_rows(size) or size > batch_bytes:
                batches.append([sha])  # read on its own
                room = -1
            elif size <= room and len(batches[-1]) < _IN_LIST:
                batches[-1].append(sha)
                room -= size
            else:
                batches.append([sha])
                room = batch_bytes - size
        pending: asyncio.Task[list[bytes]] | None = None
        try:
            for index, batch in enumerate(batches):
                current = pending or asyncio.ensure_future(self._read_batch(batch))
                pending = None
                datas = await current
                if index + 1 < len(batches):
                    pending = asyncio.ensure_future(self._read_batch(batches[index + 1]))
                for data in datas:
                    yield data
        finally:
            if pending is not None:
                pending.cancel()
                if pending.done() and not pending.cancelled():
                    pending.exception()  # retrieved: the caller stopped before it mattered

    async def _read_batch(self, batch: Sequence[str]) -> list[bytes]:
        found: dict[str, bytes] = {}
        if len(batch) > 1:
            async with self._db.read() as conn:
                found_rows = await conn.execute(_whole_blobs(batch))
                rows = [(row.sha256, row.size_bytes, bytes(row.data)) for row in found_rows]
            await self._check_rows(rows)
            found = {sha: data for sha, _, data in rows}
        # Blobs kept elsewhere (files, several chunks) and any hash that is not stored (NotFound).
        return [found[sha] if sha in found else await self.read(sha) for sha in batch]

    async def _check_rows(self, rows: Sequence[tuple[str, int, bytes]]) -> None:
        """Checks blobs read whole as rows; a batch of many bytes is hashed off the event loop."""
        unknown = [row for row in rows if not self.integrity.known_good(row[0])]
        for sha, _, _ in unknown:
            self.integrity.raise_if_known_bad(sha)

        def digests() -> list[str]:
            return [hashlib.sha256(data).hexdigest() for _, _, data in unknown]

        if sum(len(data) for _, _, data in unknown) >= _THREAD_HASH_BYTES:
            hashes = await asyncio.to_thread(digests)
        else:
            hashes = digests()
        for (sha, size, data), actual in zip(unknown, hashes, strict=True):
            self.integrity.judge(sha, size, actual, len(data))

    # ---- deletion and collection ----
    async def _delete_blobs(
        self, conn: AsyncConnection, condition: sa.ColumnElement[bool]
    ) -> list[tuple[str, int]]:
        """Deletes the blob rows matching ``condition`` and their bytes, in the caller's transaction.

        The bytes go before the commit: a blob stored again meanwhile waits for this transaction (its
        row is locked) and then writes its bytes anew, never finding them removed after it wrote them.
        """
        gone = await conn.execute(
            sa.delete(blobs).where(condition).returning(blobs.c.sha256, blobs.c.size_bytes)
        )
        deleted = [(row.sha256, row.size_bytes) for row in gone]
        if deleted:
            await self._bytes.remove(conn, [sha for sha, _ in deleted])
        return deleted

    def drop_new(self, conn: sa.Connection, sha256s: Collection[str]) -> None:
        """Inside the transaction that stored them (:meth:`prepare_many`'s work), deletes blobs nothing
        came to use (a refused or late report's payload): their rows and bytes never commit."""
        if sha256s:
            conn.execute(sa.delete(blobs).where(blobs.c.sha256.in_(sorted(sha256s))))
            self._bytes.remove_objects(conn, sha256s)

    def mark_used(self, conn: sa.Connection, uploads: Collection[tuple[str, str]]) -> None:
        """Inside the transaction that records them as results: the ``(sha256, device_id)`` uploads are
        used (their held markers go, their blobs count as stored now)."""
        if uploads:
            conn.execute(sa.delete(blob_uploads).where(blob_uploads.c.upload_key.in_(held_keys(uploads))))
            conn.execute(_touch(self._clock.now()), {"sha256s": sorted({sha for sha, _ in uploads})})

    async def _delete_where(self, condition: sa.ColumnElement[bool]) -> int:
        async def work(conn: AsyncConnection) -> list[tuple[str, int]]:
            return await self._delete_blobs(conn, condition)

        deleted = await self._db.write(work)
        self.integrity.forget([sha for sha, _ in deleted])
        return sum(size for _, size in deleted)

    async def delete(self, sha256: str) -> int:
        """Delete a blob even if referenced; return the bytes freed (0 if it was not stored)."""
        return await self._delete_where(blobs.c.sha256 == sha256)

    async def delete_if_unreferenced(self, candidates: Collection[str]) -> int:
        """Delete those of ``candidates`` that nothing references any more; return the bytes freed."""
        if not candidates:
            return 0
        checked_at = self._clock.now()

        async def work(conn: AsyncConnection) -> list[tuple[str, int]]:
            unused = set(candidates) - await referenced_among(conn, candidates, array=not self._db.is_sqlite)
            if not unused:
                return []
            # One stored again since the check (moved to a later created_at) is left alone.
            return await self._delete_blobs(
                conn, sa.and_(blobs.c.sha256.in_(sorted(unused)), blobs.c.created_at <= checked_at)
            )

        deleted = await self._db.write(work)
        self.integrity.forget([sha for sha, _ in deleted])
        return sum(size for _, size in deleted)

    async def gc_unreferenced(self, older_than: datetime) -> int:
        """Delete blobs created before ``older_than`` that nothing references, and stale uploads.

        Returns the bytes freed. (:meth:`collect` with both cutoffs at ``older_than``, looking at every
        blob.)
        """
        self._full_sweep_at = None
        return (await self.collect(unused_before=older_than, idle_uploads_before=older_than)).total_bytes

    async def collect(self, *, unused_before: datetime, idle_uploads_before: datetime) -> CollectedBlobs:
        """Delete what nothing uses, with its bytes: blobs unused since before ``unused_before``,
        partial uploads idle since before ``idle_uploads_before``, and held-upload markers (``uh-``)
        older than ``unused_before``.

        A blob counts as used while a job, run, task, result or checkpoint points at it (see
        :mod:`blob_refs`); one stored again meanwhile counts as stored then. Each collection looks at
        the blobs that became old since the one before (a blob whose last user goes later is freed
        by that user's own path: a pruned checkpoint, a deleted job); the first one of a process, and
        one every :data:`FULL_SWEEP_EVERY`, look at every blob, and at the files no row names.
        """
        now = self._clock.now()
        full = self._full_sweep_at is None or now - self._full_sweep_at >= FULL_SWEEP_EVERY
        uploads, upload_bytes = await self._collect_uploads(idle_uploads_before, unused_before)
        since = None if full or self._swept_until is None else min(self._swept_until, unused_before)
        deleted = await self._collect_blobs(unused_before, since)
        orphans: list[tuple[str, int]] = []
        if full:
            orphans = await self._collect_orphan_files(now - idle_uploads_before)
            self._full_sweep_at = now
        swept = self._swept_until
        self._swept_until = unused_before if swept is None else max(swept, unused_before)
        return CollectedBlobs(
            blobs=len(deleted),
            blob_bytes=sum(size for _, size in deleted),
            uploads=uploads,
            upload_bytes=upload_bytes,
            orphan_files=len(orphans),
            orphan_bytes=sum(size for _, size in orphans),
        )

    async def _collect_uploads(self, idle_before: datetime, unused_before: datetime) -> tuple[int, int]:
        held = blob_uploads.c.upload_key.startswith("uh-")

        async def work(conn: AsyncConnection) -> list[tuple[str, int]]:
            stale = await conn.execute(
                sa.delete(blob_uploads)
                .where(blob_uploads.c.created_at < idle_before, ~held)
                .returning(blob_uploads.c.upload_key, blob_uploads.c.received_bytes)
            )
            gone = [(row.upload_key, row.received_bytes) for row in stale]
            if gone:
                await self._bytes.remove(conn, [key for key, _ in gone])
            # Markers of complete uploads never used: the blob itself goes when nothing uses it.
            await conn.execute(sa.delete(blob_uploads).where(held, blob_uploads.c.created_at < unused_before))
            return gone

        gone = await self._db.write(work)
        return len(gone), sum(received for _, received in gone)

    async def _collect_blobs(self, cutoff: datetime, since: datetime | None) -> list[tuple[str, int]]:
        """Deletes the blobs created in [since, cutoff) that nothing uses."""
        old = blobs.c.created_at < cutoff
        window = old if since is None else sa.and_(old, blobs.c.created_at >= since)
        async with self._db.read() as conn:
            candidates = list((await conn.execute(sa.select(blobs.c.sha256).where(window))).scalars())
            if not candidates:
                return []
            # Read in the same snapshot as the candidates (set-wise: one pass per referencing table).
            used = await referenced_among(conn, candidates, array=not self._db.is_sqlite)
        unused = sorted(set(candidates) - used)
        deleted: list[tuple[str, int]] = []
        for start in range(0, len(unused), _IN_LIST):
            batch = unused[start : start + _IN_LIST]

            async def work(conn: AsyncConnection, batch: list[str] = batch) -> list[tuple[str, int]]:
                # Only if still old: a blob stored again since (about to be used) has moved on.
                return await self._delete_blobs(conn, sa.and_(blobs.c.sha256.in_(batch), old))

            deleted.extend(await self._db.write(work))
        self.integrity.forget([sha for sha, _ in deleted])
        return deleted

    async def _collect_orphan_files(self, age: timedelta) -> list[tuple[str, int]]:
        """Deletes files, older than ``age`` by the wall clock, that no blob or upload row names (a
        crash between writing a file and committing its row leaves one)."""
        files = await self._bytes.old_files(age)
        if not files:
            return []
        keys = [key for key, _ in files]

        async def work(conn: AsyncConnection) -> list[tuple[str, int]]:
            named: set[str] = set()
            for start in range(0, len(keys), _IN_LIST):
                batch = keys[start : start + _IN_LIST]
                stored = sa.select(blobs.c.sha256).where(blobs.c.sha256.in_(batch))
                named.update((await conn.execute(stored)).scalars())
                named.update(
                    (
                        await conn.execute(
                            sa.select(blob_uploads.c.upload_key).where(blob_uploads.c.upload_key.in_(batch))
                        )
                    ).scalars()
                )
            orphans = [(key, size) for key, size in files if key not in named and not is_held_key(key)]
            if orphans:
                await self._bytes.remove(conn, [key for key, _ in orphans])
            return orphans

        return await self._db.write(work)
