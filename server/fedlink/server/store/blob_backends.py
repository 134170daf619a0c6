"""Where blob bytes live: in the database in chunks, or in a directory on disk.

Blob metadata (the ``blobs`` and ``blob_uploads`` tables) is always in the database; a backend only
keeps bytes, under an upload key while an upload is in flight and under the sha256 once committed.
Backends never hold a whole blob in memory: they take and give chunks.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Collection, Sequence
from pathlib import Path
from typing import BinaryIO, Protocol

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.server.store.dialect import Database
from fedlink.server.store.protocol import CHUNK_SIZE
from fedlink.server.store.schema import blob_chunks


class BlobBytes(Protocol):
    """The byte-keeping half of the blob store."""

    async def write(self, conn: AsyncConnection, key: str, offset: int, data: bytes) -> None:
        """Write ``data`` at ``offset`` of the bytes under ``key`` (truncating anything after it)."""
        ...

    async def rename(self, conn: AsyncConnection, key: str, sha256: str) -> None:
        """Make the bytes under upload ``key`` the committed blob ``sha256``."""
        ...

    async def remove(self, conn: AsyncConnection, keys: Collection[str]) -> None:
        """Forget the bytes under ``keys`` (missing ones are ignored)."""
        ...

    def read(self, key: str, offset: int, chunk_size: int) -> AsyncIterator[bytes]:
        """Yield the bytes under ``key`` from ``offset`` in chunks of at most ``chunk_size``."""
        ...

    async def prepare_objects(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Before the transaction that records blobs ``(sha256, data)``: store what lives outside it."""
        ...

    async def insert_objects(self, conn: AsyncConnection, items: Sequence[tuple[str, bytes]]) -> None:
        """Inside that transaction: store what lives in the database."""
        ...


async def sha256_of(source: BlobBytes, key: str) -> tuple[str, int]:
    """Hash the bytes under ``key`` chunk by chunk; return (hex digest, size)."""
    digest = hashlib.sha256()
    size = 0
    async for chunk in source.read(key, 0, CHUNK_SIZE):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


class DatabaseBytes:
    """Blob bytes in the ``blob_chunks`` table: shared by every coordinator on the same database."""

    def __init__(self, database: Database) -> None:
        self._db = database

    async def write(self, conn: AsyncConnection, key: str, offset: int, data: bytes) -> None:
        """Store ``data`` as chunks of at most CHUNK_SIZE from ``offset``."""
        await conn.execute(
            sa.delete(blob_chunks).where(blob_chunks.c.blob_key == key, blob_chunks.c.offset >= offset)
        )
        rows = [
            {"blob_key": key, "offset": offset + start, "size": len(piece), "data": piece}
            for start in range(0, len(data), CHUNK_SIZE)
            if (piece := data[start : start + CHUNK_SIZE])
        ]
        if rows:
            await conn.execute(sa.insert(blob_chunks), rows)

    async def prepare_objects(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Nothing lives outside the database."""

    async def insert_objects(self, conn: AsyncConnection, items: Sequence[tuple[str, bytes]]) -> None:
        """Write each blob's chunks under its hash, in the caller's transaction."""
        rows = [
            {"blob_key": sha256, "offset": start, "size": len(piece), "data": piece}
            for sha256, data in items
            for start in range(0, len(data), CHUNK_SIZE)
            if (piece := data[start : start + CHUNK_SIZE])
        ]
        if rows:
            await conn.execute(sa.insert(blob_chunks), rows)

    async def rename(self, conn: AsyncConnection, key: str, sha256: str) -> None:
        """Re-key the upload's chunks to the blob's hash."""
        await conn.execute(
            sa.update(blob_chunks).where(blob_chunks.c.blob_key == key).values(blob_key=sha256)
        )

    async def remove(self, conn: AsyncConnection, keys: Collection[str]) -> None:
        """Delete the chunks of ``keys``."""
        if keys:
            await conn.execute(sa.delete(blob_chunks).where(blob_chunks.c.blob_key.in_(list(keys))))

    async def read(self, key: str, offset: int, chunk_size: int) -> AsyncIterator[bytes]:
        """Fetch one stored chunk per query, so memory stays at one chunk."""
        layout_query = (
            sa.select(blob_chunks.c.offset, blob_chunks.c.size)
            .where(blob_chunks.c.blob_key == key, blob_chunks.c.offset + blob_chunks.c.size > offset)
            .order_by(blob_chunks.c.offset)
        )
        async with self._db.read() as conn:
            layout = (await conn.execute(layout_query)).all()
        for start, size in layout:
            async with self._db.read() as conn:
                data = (
                    await conn.execute(
                        sa.select(blob_chunks.c.data).where(
                            blob_chunks.c.blob_key == key, blob_chunks.c.offset == start
                        )
                    )
                ).scalar_one()
            assert len(data) == size
            piece = bytes(data[max(0, offset - start) :])
            for at in range(0, len(piece), chunk_size):
                yield piece[at : at + chunk_size]


class DirectoryBytes:
    """Blob bytes as files under a directory: ``objects/ab/<sha256>`` and ``uploads/<key>``."""

    def __init__(self, root: Path) -> None:
        self._root = root
        (root / "objects").mkdir(parents=True, exist_ok=True)
        (root / "uploads").mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if len(key) == 64 and all(c in "0123456789abcdef" for c in key):
            return self._root / "objects" / key[:2] / key
        return self._root / "uploads" / key

    def _write_sync(self, key: str, offset: int, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "r+b" if path.exists() else "wb") as f:
            f.truncate(offset)
            f.seek(offset)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    async def write(self, conn: AsyncConnection, key: str, offset: int, data: bytes) -> None:
        """Write (and fsync) ``data`` at ``offset`` of the file for ``key``."""
        await asyncio.to_thread(self._write_sync, key, offset, data)

    def _put_objects_sync(self, items: Sequence[tuple[str, bytes]]) -> None:
        for sha256, data in items:
            target = self._path(sha256)
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{sha256}.{os.getpid()}.partial")
            with open(partial, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, target)  # content-addressed: a file under its hash is always complete

    async def prepare_objects(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Write (and fsync) each blob's file under its hash, outside any transaction.

        A crash before the blob rows commit leaves files no row points to; gc removes them.
        """
        if items:
            await asyncio.to_thread(self._put_objects_sync, items)

    async def insert_objects(self, conn: AsyncConnection, items: Sequence[tuple[str, bytes]]) -> None:
        """Nothing lives in the database."""

    def _rename_sync(self, key: str, sha256: str) -> None:
        target = self._path(sha256)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(self._path(key), target)

    async def rename(self, conn: AsyncConnection, key: str, sha256: str) -> None:
        """Move the upload's file to its place under ``objects/``."""
        await asyncio.to_thread(self._rename_sync, key, sha256)

    def _remove_sync(self, keys: Collection[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    async def remove(self, conn: AsyncConnection, keys: Collection[str]) -> None:
        """Delete the files of ``keys``."""
        if keys:
            await asyncio.to_thread(self._remove_sync, keys)

    def _open_sync(self, key: str, offset: int) -> BinaryIO:
        f = open(self._path(key), "rb")  # noqa: SIM115 - closed by read(), across its yields
        f.seek(offset)
        return f

    async def read(self, key: str, offset: int, chunk_size: int) -> AsyncIterator[bytes]:
        """Read the file for ``key`` chunk by chunk; one worker-thread hop reads a few MiB of chunks.

        The file stays open for the whole read: a blob deleted meanwhile is still read to its end.
        """
        f = await asyncio.to_thread(self._open_sync, key, offset)
        try:
            per_hop = max(1, _READ_AHEAD_BYTES // chunk_size)
            while chunks := await asyncio.to_thread(_read_chunks, f, chunk_size, per_hop):
                for chunk in chunks:
                    yield chunk
                if len(chunks) < per_hop or len(chunks[-1]) < chunk_size:
                    return
        finally:
            f.close()


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
