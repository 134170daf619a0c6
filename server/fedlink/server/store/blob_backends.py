"""Where blob bytes live: in the database in chunks, or in a directory on disk (small blobs as rows).

Blob metadata (the ``blobs`` and ``blob_uploads`` tables) is always in the database; a backend only
keeps bytes, under an upload key while an upload is in flight and under the sha256 once committed.
Backends never hold a whole large blob in memory: they take and give chunks. When blob files are
fsynced is decided in one place, :func:`blob_files_need_fsync`.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import time
from collections.abc import AsyncGenerator, Collection, Sequence
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO, Protocol

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.common.files import fsync_directory
from fedlink.server.store.dialect import Database
from fedlink.server.store.protocol import CHUNK_SIZE
from fedlink.server.store.schema import blob_chunks

#: Largest blob ``put_many`` keeps as a row (one chunk) when blobs otherwise go to files.
SMALL_BLOB_BYTES = 256 * 1024
#: Chunks hashed in a worker thread rather than on the event loop.
_THREAD_HASH_BYTES = 256 * 1024
#: Blob files hold models and devices' updates: owner-only, whatever the umask or the parent's mode.
_FILE_MODE = 0o600
_DIR_MODE = 0o700


class BlobBytes(Protocol):
    """The byte-keeping half of the blob store."""

    async def write(self, conn: AsyncConnection, key: str, offset: int, data: bytes) -> None:
        """Write ``data`` at ``offset`` of the bytes under ``key`` (truncating anything after it).

        Not yet durable: :meth:`sync` makes it so before the blob is committed.
        """
        ...

    async def sync(self, key: str) -> None:
        """Make the bytes under upload ``key`` as durable as the row that will reference them."""
        ...

    async def rename(self, conn: AsyncConnection, key: str, sha256: str) -> None:
        """Make the bytes under upload ``key`` the committed blob ``sha256``."""
        ...

    async def remove(self, conn: AsyncConnection, keys: Collection[str]) -> None:
        """Forget the bytes under ``keys`` (missing ones are ignored)."""
        ...

    def read(self, key: str, offset: int, chunk_size: int) -> AsyncGenerator[bytes, None]:
        """Yield the bytes under ``key`` from ``offset`` in chunks of at most ``chunk_size``."""
        ...

    async def digest(self, key: str) -> tuple[str, int]:
        """Hash the bytes under ``key``; return (hex sha256, size). FileNotFoundError if a file is gone."""
        ...

    async def old_files(self, age: timedelta) -> list[tuple[str, int]]:
        """The keys and sizes of the files kept outside the database that were last written more than
        ``age`` ago by the wall clock (a crashed write's partial files that old are removed here)."""
        ...

    def in_rows(self, size_bytes: int) -> bool:
        """Tell whether a blob of ``size_bytes`` is a row (:meth:`insert_objects`) or not."""
        ...

    async def prepare_objects(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Before the transaction that records blobs ``(sha256, data)``: store those not :meth:`in_rows`."""
        ...

    def insert_objects(self, conn: sa.Connection, items: Sequence[tuple[str, bytes]]) -> None:
        """Inside that transaction: store the bytes of ``items`` that are not stored (those
        :meth:`in_rows`, and any other whose bytes went missing since :meth:`prepare_objects`, e.g.
        collected meanwhile)."""
        ...

    def remove_objects(self, conn: sa.Connection, sha256s: Collection[str]) -> None:
        """Inside a transaction: forget the bytes of blobs ``sha256s`` (rows and files)."""
        ...


async def sha256_of(source: BlobBytes, key: str) -> tuple[str, int]:
    """Hash the bytes under ``key`` chunk by chunk; return (hex digest, size)."""
    digest = hashlib.sha256()
    size = 0
    async for chunk in source.read(key, 0, CHUNK_SIZE):
        if len(chunk) >= _THREAD_HASH_BYTES:
            await asyncio.to_thread(digest.update, chunk)  # hashlib releases the GIL: off the loop
        else:
            digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def _chunk_rows(key: str, offset: int, data: bytes) -> list[dict[str, object]]:
    return [
        {"blob_key": key, "offset": offset + start, "size": len(piece), "data": piece}
        for start in range(0, len(data), CHUNK_SIZE)
        if (piece := data[start : start + CHUNK_SIZE])
    ]


class DatabaseBytes:
    """Blob bytes in the ``blob_chunks`` table: shared by every coordinator on the same database."""

    def __init__(self, database: Database) -> None:
        self._db = database

    async def write(self, conn: AsyncConnection, key: str, offset: int, data: bytes) -> None:
        """Store ``data`` as chunks of at most CHUNK_SIZE from ``offset``."""
        await conn.execute(
            sa.delete(blob_chunks).where(blob_chunks.c.blob_key == key, blob_chunks.c.offset >= offset)
        )
        if rows := _chunk_rows(key, offset, data):
            await conn.execute(sa.insert(blob_chunks), rows)

    async def sync(self, key: str) -> None:
        """Chunks are rows: they commit with the blob."""

    def in_rows(self, size_bytes: int) -> bool:
        """Every blob is kept in rows."""
        return True

    async def prepare_objects(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Nothing lives outside the database."""

    def insert_objects(self, conn: sa.Connection, items: Sequence[tuple[str, bytes]]) -> None:
        """Write each blob's chunks under its hash, in the caller's transaction.

        Chunks already there (a blob stored again) hold the same bytes (the key is their hash), so a
        conflict keeps them; missing ones are written.
        """
        rows = [row for sha256, data in items for row in _chunk_rows(sha256, 0, data)]
        if rows:
            conn.execute(self._db.insert_ignore(blob_chunks), rows)

    def remove_objects(self, conn: sa.Connection, sha256s: Collection[str]) -> None:
        """Delete the chunks of ``sha256s`` in the caller's transaction."""
        if sha256s:
            conn.execute(sa.delete(blob_chunks).where(blob_chunks.c.blob_key.in_(sorted(sha256s))))

    async def rename(self, conn: AsyncConnection, key: str, sha256: str) -> None:
        """Re-key the upload's chunks to the blob's hash."""
        await conn.execute(
            sa.update(blob_chunks).where(blob_chunks.c.blob_key == key).values(blob_key=sha256)
        )

    async def remove(self, conn: AsyncConnection, keys: Collection[str]) -> None:
        """Delete the chunks of ``keys``."""
        if keys:
            await conn.execute(sa.delete(blob_chunks).where(blob_chunks.c.blob_key.in_(list(keys))))

    async def first_chunk(self, key: str) -> bytes | None:
        """The chunk at offset 0 of ``key`` (None if there is none): a whole blob if it is a small one."""
        query = sa.select(blob_chunks.c.data).where(blob_chunks.c.blob_key == key, blob_chunks.c.offset == 0)
        async with self._db.read() as conn:
            data = (await conn.execute(query)).scalar()
        return None if data is None else bytes(data)

    async def read(self, key: str, offset: int, chunk_size: int) -> AsyncGenerator[bytes, None]:
        """Fetch one stored chunk per query, so memory stays at one chunk."""
        layout_query = (
            sa.select(blob_chunks.c.offset, blob_chunks.c.size)
            .where(blob_chunks.c.blob_key == key, blob_chunks.c.offset + blob_chunks.c.size > offset)
            .order_by(blob_chunks.c.offset)
        )
        async with self._db.read() as conn:
            layout = (await conn.execute(layout_query)).all()
        for start, _size in layout:
            async with self._db.read() as conn:
                data = (
                    await conn.execute(
                        sa.select(blob_chunks.c.data).where(
                            blob_chunks.c.blob_key == key, blob_chunks.c.offset == start
                        )
                    )
                ).scalar()
            if data is None:
                return  # deleted meanwhile: what was read is short, which the blob's check tells
            # A chunk is given as it is stored, even if it is not the size its row says: the blob's
            # sha256 check (integrity.py) tells a tampered chunk, never an assertion here.
            piece = bytes(data[max(0, offset - start) :])
            for at in range(0, len(piece), chunk_size):
                yield piece[at : at + chunk_size]

    async def digest(self, key: str) -> tuple[str, int]:
        """Hash the chunks of ``key``, one query per chunk."""
        return await sha256_of(self, key)

    async def old_files(self, age: timedelta) -> list[tuple[str, int]]:
        """No files: every byte is in the database."""
        return []


def blob_files_need_fsync(database: Database) -> bool:
    """The fsync policy of blob files: a file is durable no later than the row that references it.

    * PostgreSQL commits are durable (its WAL is flushed at commit), so a blob file is fsynced, and
      its directory after the rename that names it, before the transaction that records it commits.
    * A SQLite file runs WAL with ``synchronous=NORMAL``: commits are not fsynced. They survive a
      crash of the process but not necessarily a power loss, and so does a written file (it is in
      the page cache); fsyncing files would make blobs more durable than the rows naming them, so
      no fsync is made. The rows themselves may become durable at a WAL checkpoint before the
      kernel writes a large blob's file back: after a power loss such a blob can be missing.
      (Small blobs are rows; this only concerns blobs over :data:`SMALL_BLOB_BYTES`.)
    * An in-memory SQLite database does not outlive the process: nothing is fsynced.

    An upload's chunks are never fsynced one by one: the file is fsynced once, when the upload
    commits (its hash is checked then, so a torn upload is discarded, never published).
    """
    return not database.is_sqlite


class DirectoryBytes:
    """Blob files under a directory (``objects/ab/<sha256>``, ``uploads/<key>``); small blobs as rows.

    A blob of at most ``small_blob_bytes`` stored by ``put_many`` goes to the ``blob_chunks`` table
    (one chunk) with the transaction that records it: no file, no fsync, and a round's results can
    be read back with one query. Blobs written as files before that (or uploaded) are still read
    from their files: a read looks in the table first. Without a database every blob is a file
    (and fsynced unless told otherwise).
    """

    def __init__(
        self,
        root: Path,
        database: Database | None = None,
        *,
        fsync: bool | None = None,
        small_blob_bytes: int = SMALL_BLOB_BYTES,
    ) -> None:
        self._root = root
        self._rows = DatabaseBytes(database) if database is not None else None
        #: Whether files are fsynced before the rows naming them commit (see blob_files_need_fsync).
        self.fsync = (database is None or blob_files_need_fsync(database)) if fsync is None else fsync
        self._small = min(small_blob_bytes, CHUNK_SIZE) if database is not None else -1
        # A directory given by the operator may already exist, 0755: what is created in it is private.
        root.mkdir(parents=True, exist_ok=True, mode=_DIR_MODE)
        (root / "objects").mkdir(exist_ok=True, mode=_DIR_MODE)
        (root / "uploads").mkdir(exist_ok=True, mode=_DIR_MODE)

    def _path(self, key: str) -> Path:
        if _is_sha256(key):
            return self._root / "objects" / key[:2] / key
        return self._root / "uploads" / key

    def _write_sync(self, key: str, offset: int, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True, mode=_DIR_MODE)
        with open(path, "r+b" if path.exists() else "wb", opener=_private) as f:
            f.truncate(offset)
            f.seek(offset)
            f.write(data)

    async def write(self, conn: AsyncConnection, key: str, offset: int, data: bytes) -> None:
        """Write ``data`` at ``offset`` of the file for ``key`` (no fsync: :meth:`sync` does it once)."""
        await asyncio.to_thread(self._write_sync, key, offset, data)

    def _sync_file(self, key: str) -> None:
        with open(self._path(key), "rb") as f:
            os.fsync(f.fileno())

    async def sync(self, key: str) -> None:
        """Fsync the upload's file if the policy asks for it."""
        if self.fsync:
            await asyncio.to_thread(self._sync_file, key)

    def in_rows(self, size_bytes: int) -> bool:
        """Blobs up to the small-blob threshold are rows."""
        return size_bytes <= self._small

    def _put_objects_sync(self, items: Sequence[tuple[str, bytes]]) -> None:
        for sha256, data in items:
            target = self._path(sha256)
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True, mode=_DIR_MODE)
            partial = target.with_name(f".{sha256}.{os.getpid()}.partial")
            with open(partial, "wb", opener=_private) as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(partial, target)  # content-addressed: a file under its hash is always complete
            if self.fsync:
                fsync_directory(target.parent)

    async def prepare_objects(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Write each large blob's file under its hash, outside any transaction.

        A crash before the blob rows commit leaves files no row points to, which are harmless.
        """
        large = [(sha256, data) for sha256, data in items if not self.in_rows(len(data))]
        if large:
            await asyncio.to_thread(self._put_objects_sync, large)

    def insert_objects(self, conn: sa.Connection, items: Sequence[tuple[str, bytes]]) -> None:
        """Store the small blobs as rows of ``blob_chunks``, in the caller's transaction, and write
        the file of a large one that is missing (its blob was deleted after :meth:`prepare_objects`
        found it stored, and is recorded again now)."""
        if self._rows is not None:
            self._rows.insert_objects(conn, [(sha, d) for sha, d in items if self.in_rows(len(d))])
        self._put_objects_sync([(sha, d) for sha, d in items if not self.in_rows(len(d))])

    def remove_objects(self, conn: sa.Connection, sha256s: Collection[str]) -> None:
        """Delete the rows and files of ``sha256s`` in the caller's transaction (before its commit: a
        writer of the same content waits for it, then finds them gone and writes them again)."""
        if self._rows is not None:
            self._rows.remove_objects(conn, sha256s)
        self._remove_sync(sha256s)

    def _rename_sync(self, key: str, sha256: str) -> None:
        target = self._path(sha256)
        target.parent.mkdir(parents=True, exist_ok=True, mode=_DIR_MODE)
        os.replace(self._path(key), target)
        if self.fsync:
            fsync_directory(target.parent)

    async def rename(self, conn: AsyncConnection, key: str, sha256: str) -> None:
        """Move the upload's file to its place under ``objects/``."""
        await asyncio.to_thread(self._rename_sync, key, sha256)

    def _remove_sync(self, keys: Collection[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    async def remove(self, conn: AsyncConnection, keys: Collection[str]) -> None:
        """Delete the rows and files of ``keys``."""
        if keys:
            if self._rows is not None:
                await self._rows.remove(conn, keys)
            await asyncio.to_thread(self._remove_sync, keys)

    def _digest_sync(self, key: str) -> tuple[str, int]:
        with open(self._path(key), "rb") as f:
            digest = hashlib.file_digest(f, "sha256")
            return digest.hexdigest(), f.tell()

    async def digest(self, key: str) -> tuple[str, int]:
        """A small blob's row, else its file, hashed whole in a worker thread."""
        if self._rows is not None and _is_sha256(key):
            whole = await self._rows.first_chunk(key)
            if whole is not None:
                return hashlib.sha256(whole).hexdigest(), len(whole)
        return await asyncio.to_thread(self._digest_sync, key)

    def _old_files_sync(self, age: timedelta) -> list[tuple[str, int]]:
        before = time.time() - age.total_seconds()
        found: list[tuple[str, int]] = []
        for path in [*(self._root / "objects").glob("*/*"), *(self._root / "uploads").iterdir()]:
            try:
                info = path.stat()
            except FileNotFoundError:
                continue  # removed meanwhile
            if not stat.S_ISREG(info.st_mode) or info.st_mtime >= before:
                continue
            if path.name.endswith(".partial"):
                path.unlink(missing_ok=True)  # a crashed write's: no row can ever name it
            elif path.parent.name == "uploads" or _is_sha256(path.name):
                found.append((path.name, info.st_size))
        return found

    async def old_files(self, age: timedelta) -> list[tuple[str, int]]:
        """Blob and upload files not written for ``age`` (in a worker thread: a directory walk)."""
        return await asyncio.to_thread(self._old_files_sync, age)

    def _open_sync(self, key: str, offset: int) -> BinaryIO:
        f = open(self._path(key), "rb")  # noqa: SIM115 - closed by read(), across its yields
        f.seek(offset)
        return f

    async def read(self, key: str, offset: int, chunk_size: int) -> AsyncGenerator[bytes, None]:
        """A small blob from its row; otherwise the file, a few MiB of chunks per worker-thread hop.

        The file stays open for the whole read: a blob deleted meanwhile is still read to its end.
        """
        if self._rows is not None and _is_sha256(key):
            whole = await self._rows.first_chunk(key)
            if whole is not None:
                for at in range(offset, len(whole), chunk_size):
                    yield whole[at : at + chunk_size]
                return
        opening = asyncio.ensure_future(asyncio.to_thread(self._open_sync, key, offset))
        try:
            f = await asyncio.shield(opening)
        except asyncio.CancelledError:
            # The worker thread opens the file all the same: close it then, not at garbage collection.
            opening.add_done_callback(_close_opened)
            raise
        try:
            per_hop = max(1, _READ_AHEAD_BYTES // chunk_size)
            while chunks := await asyncio.to_thread(_read_chunks, f, chunk_size, per_hop):
                for chunk in chunks:
                    yield chunk
                if len(chunks) < per_hop or len(chunks[-1]) < chunk_size:
                    return
        finally:
            f.close()


def _close_opened(opening: asyncio.Future[BinaryIO]) -> None:
    """Closes the file a read that was cancelled while opening it got after all."""
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


def _private(path: str, flags: int) -> int:
    """``open()``'s opener for blob files: a file it creates is 0600."""
    return os.open(path, flags | os.O_CLOEXEC, _FILE_MODE)


def _is_sha256(key: str) -> bool:
    return len(key) == 64 and all(c in "0123456789abcdef" for c in key)


#: What one worker-thread hop of DirectoryBytes.read reads: a thread hop per 1 MiB chunk costs more
#: than the read itself when the bytes are in the page cache.
_READ_AHEAD_BYTES = 4 * 1024 * 1024


def _read_chunks(f: BinaryIO, chunk_size: int, count: int) -> list[bytes]:
    """Up to ``count`` chunks of ``chunk_size`` bytes (the last one may be short) from ``f``."""
    chunks: list[bytes] = []
    while len(chunks) < count:
        chunk = f.read(chunk_size)
        if chunk:
            chunks.append(chunk)
        if len(chunk) < chunk_size:
            break
    return chunks
