"""Contract: a blob whose stored bytes no longer hash to its sha256 (overwritten in place, truncated, gone)
is never handed out, by any read, and is logged at ERROR naming it; good blobs read as before.

The bytes are damaged where each backend keeps them, behind the store's back, before the store first
reads them: a file next to a SQLite file, chunk rows in the database.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.common.errors import DataLoss
from fedlink.server.store import CHUNK_SIZE, SqlStateStore
from fedlink.server.store.schema import blob_chunks

SMALL = hashlib.sha256(b"small").digest() * 100  # 3,200 bytes: one row in every backend
BIG = os.urandom(2 * CHUNK_SIZE + 4321)  # a file next to SQLite, three chunk rows in the database

Damage = Callable[[SqlStateStore, Path, str], Awaitable[None]]


def _file(tmp_path: Path, sha: str) -> Path | None:
    path = tmp_path / "fedlink.db.blobs" / "objects" / sha[:2] / sha
    return path if path.exists() else None


async def _last_chunk(store: SqlStateStore, sha: str) -> tuple[int, bytes]:
    async with store.database.read() as conn:
        row = (
            await conn.execute(
                sa.select(blob_chunks.c.offset, blob_chunks.c.data)
                .where(blob_chunks.c.blob_key == sha)
                .order_by(blob_chunks.c.offset.desc())
                .limit(1)
            )
        ).one()
    return int(row.offset), bytes(row.data)


async def _set_chunk(store: SqlStateStore, sha: str, offset: int, data: bytes) -> None:
    async def work(conn: AsyncConnection) -> None:
        await conn.execute(
            sa.update(blob_chunks)
            .where(blob_chunks.c.blob_key == sha, blob_chunks.c.offset == offset)
            .values(data=data)
        )

    await store.database.write(work)


def overwrite(path: Path, offset: int, data: bytes) -> None:
    """Writes ``data`` over the file's bytes at ``offset`` (the length stays)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


async def overwrite_4_bytes(store: SqlStateStore, tmp_path: Path, sha: str) -> None:
    """Four bytes in the middle of the last chunk become 12345.0 as float32: same length."""
    evil = b"\x00\xe4\x40\x46"
    path = _file(tmp_path, sha)
    if path is not None:
        overwrite(path, path.stat().st_size // 2, evil)
        return
    offset, data = await _last_chunk(store, sha)
    middle = len(data) // 2
    await _set_chunk(store, sha, offset, data[:middle] + evil + data[middle + 4 :])


async def truncate(store: SqlStateStore, tmp_path: Path, sha: str) -> None:
    """The last 100 bytes are cut off (the chunk row keeps saying its old size)."""
    path = _file(tmp_path, sha)
    if path is not None:
        os.truncate(path, path.stat().st_size - 100)
        return
    offset, data = await _last_chunk(store, sha)
    await _set_chunk(store, sha, offset, data[:-100])


async def remove(store: SqlStateStore, tmp_path: Path, sha: str) -> None:
    """The bytes are gone altogether (the file deleted, or the chunk rows)."""
    path = _file(tmp_path, sha)
    if path is not None:
        path.unlink()
        return

    async def work(conn: AsyncConnection) -> None:
        await conn.execute(sa.delete(blob_chunks).where(blob_chunks.c.blob_key == sha))

    await store.database.write(work)


READS: dict[str, Callable[[SqlStateStore, str], Awaitable[bytes]]] = {
    "read": lambda store, sha: store.blobs.read(sha),
    "read a range": lambda store, sha: store.blobs.read(sha, offset=10, size=20),
    "iter_chunks": lambda store, sha: _join(store.blobs.iter_chunks(sha)),
    "iter_chunks from an offset": lambda store, sha: _join(store.blobs.iter_chunks(sha, offset=1)),
    "read_each": lambda store, sha: _join(store.blobs.read_each([sha, sha])),
}


async def _join(chunks: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in chunks])


@pytest.mark.parametrize("damage", [overwrite_4_bytes, truncate, remove], ids=lambda d: d.__name__)
@pytest.mark.parametrize("data", [SMALL, BIG], ids=["small", "big"])
async def test_a_damaged_blob_is_never_handed_out_and_is_logged_once(
    store: SqlStateStore, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Damage, data: bytes
) -> None:
    ref = await store.blobs.put_bytes(data)
    good = await store.blobs.put_bytes(data[::-1])
    told: list[str] = []
    store.blobs.integrity.listeners.append(lambda sha, message: told.append(sha))
    await damage(store, tmp_path, ref.sha256)
    with caplog.at_level(logging.ERROR, logger="fedlink.server.store.integrity"):
        for name, read in READS.items():
            with pytest.raises(DataLoss, match=f"blob {ref.sha256} is corrupted") as error:
                await read(store, ref.sha256)
            assert "Restore the blob from a backup" in error.value.message, name
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and ref.sha256 in errors[0].getMessage(), "logged once, naming the blob"
    assert told == [ref.sha256]
    assert await store.blobs.read(good.sha256) == data[::-1]  # the others read as before


async def test_reads_of_good_blobs_are_unchanged(store: SqlStateStore) -> None:
    for data in (b"", SMALL, BIG):
        ref = await store.blobs.put_bytes(data)
        for name, read in READS.items():
            if not data and ("range" in name or "offset" in name):
                continue  # an empty blob has no byte 1 or 10
            expected = {"read a range": data[10:30], "iter_chunks from an offset": data[1:]}.get(name, data)
            if name == "read_each":
                expected = data + data
            assert await read(store, ref.sha256) == expected, name


async def test_a_blob_found_bad_is_checked_again_later_and_believed_once_restored(
    store: SqlStateStore, tmp_path: Path
) -> None:
    ref = await store.blobs.put_bytes(BIG)
    await truncate(store, tmp_path, ref.sha256)
    with pytest.raises(DataLoss):
        await store.blobs.read(ref.sha256)
    await store.blobs.delete(ref.sha256)  # an operator restores it: stored again, checked again
    await store.blobs.put_bytes(BIG)
    assert await store.blobs.read(ref.sha256) == BIG
