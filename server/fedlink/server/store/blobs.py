"""The content-addressed blob store: metadata in the database, bytes in a :mod:`blob_backends` backend."""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.common.errors import FailedPrecondition, InvalidArgument, NotFound
from fedlink.server.domain import Blob, Clock, new_id
from fedlink.server.store.blob_backends import BlobBytes, sha256_of
from fedlink.server.store.dialect import Database
from fedlink.server.store.protocol import CHUNK_SIZE, READ_BATCH_BYTES, BlobRef
from fedlink.server.store.schema import (
    blob_chunks,
    blob_uploads,
    blobs,
    checkpoints,
    jobs,
    results,
    runs,
    tasks,
)

_SHA256 = re.compile(r"[0-9a-f]{64}")
# Hashes per IN list.
_IN_LIST = 500


def _check_sha(sha256: str) -> str:
    if not _SHA256.fullmatch(sha256):
        raise InvalidArgument(f"{sha256!r} is not a lowercase hex sha256")
    return sha256


def _upload_key(sha256: str, owner: str | None = None) -> str:
    if owner is None:
        return f"up-{sha256}"
    # Each owner's upload of the content is its own (resumed by it alone), under a key nobody can
    # announce as a sha256 of theirs.
    return "ud-" + hashlib.sha256(f"{owner}\n{sha256}".encode()).hexdigest()


def _whole_blobs(sha256s: Sequence[str]) -> sa.Select[Any]:
    """(sha256, data) of those of ``sha256s`` whose bytes are one ``blob_chunks`` row."""
    return (
        sa.select(blobs.c.sha256, blob_chunks.c.data)
        .join(blob_chunks, blob_chunks.c.blob_key == blobs.c.sha256)
        .where(
            blobs.c.sha256.in_(list(dict.fromkeys(sha256s))),
            blob_chunks.c.offset == 0,
            blob_chunks.c.size == blobs.c.size_bytes,
        )
    )


def unreferenced(sha_column: sa.ColumnElement[str]) -> sa.ColumnElement[bool]:
    """The condition "no job, run, task, result or checkpoint (model or workflow state) points at this
    blob"."""
    references = [
        (jobs, jobs.c.initial_model_sha256),
        (runs, runs.c.global_model_sha256),
        (runs, runs.c.workflow_state_sha256),
        (tasks, tasks.c.payload_sha256),
        (results, results.c.payload_sha256),
        (checkpoints, checkpoints.c.model_sha256),
        (checkpoints, checkpoints.c.workflow_state_sha256),
    ]
    return sa.and_(*(~sa.exists().where(column == sha_column) for _table, column in references))


class SqlBlobStore:
    """Blobs keyed by sha256: stored once per content, uploaded resumably, read as a stream."""

    def __init__(self, database: Database, clock: Clock, backend: BlobBytes) -> None:
        self._db = database
        self._clock = clock
        self._bytes = backend

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

    async def _publish(self, key: str, sha256: str, size: int) -> BlobRef:
        """Turn the finished upload under ``key`` into blob ``sha256`` (or drop it if stored already)."""
        await self._bytes.sync(key)  # durable before the row that names it commits

        async def work(conn: AsyncConnection) -> bool:
            inserted = await conn.execute(
                self._db.insert_ignore(blobs).values(
                    sha256=sha256, size_bytes=size, created_at=self._clock.now()
                )
            )
            await conn.execute(sa.delete(blob_uploads).where(blob_uploads.c.upload_key == key))
            if inserted.rowcount:
                await self._bytes.rename(conn, key, sha256)
            return bool(inserted.rowcount)

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
        if await self.exists(sha256):
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
    ) -> tuple[list[BlobRef], Callable[[sa.Connection], None] | None]:
        """:meth:`put_many` up to its transaction: the refs, and the work to run in a write transaction.

        Bytes kept outside the database are written and durable when this returns; the returned work
        inserts the blob rows (and the bytes kept as rows), so a caller can commit the blobs with its
        own rows in one transaction (the report batches of ``record_results``). The work is None when
        every blob is stored already.
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
            for sha in present:
                del wanted[sha]
            await self._bytes.prepare_objects([(sha, wanted[sha]) for sha in outside if sha not in present])
        now = self._clock.now()
        rows = [{"sha256": sha, "size_bytes": len(data), "created_at": now} for sha, data in wanted.items()]
        insert = self._db.insert_ignore(blobs).returning(blobs.c.sha256)

        if not rows:
            return refs, None

        def write(conn: sa.Connection) -> None:
            # Only the rows this transaction inserted get their bytes: a concurrent writer's are in.
            fresh = set(conn.execute(insert, rows).scalars())
            self._bytes.insert_objects(conn, [(sha, data) for sha, data in wanted.items() if sha in fresh])

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

    async def _insert_upload(self, key: str, sha256: str | None, size_bytes: int | None) -> None:
        async def work(conn: AsyncConnection) -> None:
            await conn.execute(
                self._db.insert_ignore(blob_uploads).values(
                    upload_key=key,
                    sha256=sha256,
                    size_bytes=size_bytes,
                    received_bytes=0,
                    created_at=self._clock.now(),
                )
            )

        await self._db.write(work)

    async def _discard(self, key: str) -> None:
        async def work(conn: AsyncConnection) -> None:
            await conn.execute(sa.delete(blob_uploads).where(blob_uploads.c.upload_key == key))

        await self._db.write(work)
        await self._remove_bytes([key])

    async def begin_upload(self, sha256: str, size_bytes: int, *, owner: str | None = None) -> int:
        """Start (or resume) an upload of a blob with a known hash; return the bytes received so far.

        With an ``owner`` the upload is that owner's own, and goes on even if the blob is stored:
        its bytes prove the owner holds them (see :meth:`commit_upload`).
        """
        _check_sha(sha256)
        if size_bytes < 0:
            raise InvalidArgument(f"size_bytes must be >= 0, got {size_bytes}")
        key = _upload_key(sha256, owner)
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
        """Add ``data`` at ``offset`` (which must equal the bytes received); return the new total."""
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
                .values(received_bytes=total)
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
        actual, size = await sha256_of(self._bytes, key)
        if actual != sha256 or size != upload.size_bytes:
            await self._discard(key)
            raise InvalidArgument(f"the uploaded bytes hash to {actual}, not {sha256}: upload discarded")
        return await self._publish(key, sha256, size)

    async def iter_chunks(
        self, sha256: str, offset: int = 0, chunk_size: int = CHUNK_SIZE
    ) -> AsyncIterator[bytes]:
        """Yield the blob's bytes from ``offset`` in chunks of at most ``chunk_size`` bytes."""
        blob = await self.stat(sha256)
        if not 0 <= offset <= blob.size_bytes:
            raise InvalidArgument(f"offset {offset} is outside blob {sha256} of {blob.size_bytes} bytes")
        if chunk_size < 1:
            raise InvalidArgument(f"chunk_size must be >= 1, got {chunk_size}")
        if offset == blob.size_bytes:
            return
        async for chunk in self._bytes.read(sha256, offset, chunk_size):
            yield chunk

    async def read(self, sha256: str, offset: int = 0, size: int | None = None) -> bytes:
        """Return ``size`` bytes from ``offset`` (to the end if None): for small blobs and ranges."""
        if offset == 0 and size is None:
            # A blob kept as one row comes with its metadata in one query.
            async with self._db.read() as conn:
                row = (await conn.execute(_whole_blobs([sha256]))).first()
            if row is not None:
                return bytes(row.data)
        parts: list[bytes] = []
        remaining = size
        async for chunk in self.iter_chunks(sha256, offset):
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
                found = {row.sha256: bytes(row.data) for row in await conn.execute(_whole_blobs(batch))}
        # Blobs kept elsewhere (files, several chunks) and any hash that is not stored (NotFound).
        return [found[sha] if sha in found else await self.read(sha) for sha in batch]

    async def delete(self, sha256: str) -> int:
        """Delete a blob even if referenced; return the bytes freed (0 if it was not stored)."""

        async def work(conn: AsyncConnection) -> int:
            gone = await conn.execute(
                sa.delete(blobs).where(blobs.c.sha256 == sha256).returning(blobs.c.size_bytes)
            )
            return sum(gone.scalars())

        freed = await self._db.write(work)
        await self._remove_bytes([sha256])
        return freed

    async def _delete_where(self, condition: sa.ColumnElement[bool]) -> int:
        async def work(conn: AsyncConnection) -> list[tuple[str, int]]:
            gone = await conn.execute(
                sa.delete(blobs).where(condition).returning(blobs.c.sha256, blobs.c.size_bytes)
            )
            return [(row.sha256, row.size_bytes) for row in gone]

        deleted = await self._db.write(work)
        await self._remove_bytes([sha for sha, _ in deleted])
        return sum(size for _, size in deleted)

    async def delete_if_unreferenced(self, candidates: Collection[str]) -> int:
        """Delete those of ``candidates`` that nothing references any more; return the bytes freed."""
        if not candidates:
            return 0
        return await self._delete_where(
            sa.and_(blobs.c.sha256.in_(sorted(candidates)), unreferenced(blobs.c.sha256))
        )

    async def gc_unreferenced(self, older_than: datetime) -> int:
        """Delete blobs created before ``older_than`` that nothing references, and stale uploads.

        Returns the bytes freed.
        """
        freed = await self._delete_where(
            sa.and_(blobs.c.created_at < older_than, unreferenced(blobs.c.sha256))
        )

        async def work(conn: AsyncConnection) -> list[tuple[str, int]]:
            gone = await conn.execute(
                sa.delete(blob_uploads)
                .where(blob_uploads.c.created_at < older_than)
                .returning(blob_uploads.c.upload_key, blob_uploads.c.received_bytes)
            )
            return [(row.upload_key, row.received_bytes) for row in gone]

        uploads = await self._db.write(work)
        await self._remove_bytes([key for key, _ in uploads])
        return freed + sum(received for _, received in uploads)
