"""Contract: small blobs are rows next to a blob directory, bulk reads in order, and the fsync policy.

With a blob directory, ``put_many``/``put_bytes`` keep blobs up to SMALL_BLOB_BYTES in ``blob_chunks``
(no file); larger ones, and every upload, are files. Reads find either, so blobs written as files
before small blobs became rows stay readable.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from fedlink.common.errors import NotFound
from fedlink.server.domain import ManualClock
from fedlink.server.store import CHUNK_SIZE, SqlStateStore, open_store
from fedlink.server.store.blob_backends import SMALL_BLOB_BYTES, blob_files_need_fsync
from fedlink.server.store.dialect import Database

SMALL = b"s" * SMALL_BLOB_BYTES
LARGE = os.urandom(SMALL_BLOB_BYTES + 1)
THREE_CHUNKS = os.urandom(2 * CHUNK_SIZE + 17)


def _file(blob_dir: Path, sha256: str) -> Path:
    return blob_dir / "objects" / sha256[:2] / sha256


async def _chunk_keys(url: str) -> set[str]:
    database = Database(url)
    try:
        async with database.read() as conn:
            return set((await conn.execute(sa.text("SELECT blob_key FROM blob_chunks"))).scalars())
    finally:
        await database.dispose()


async def _upload(store: SqlStateStore, data: bytes, piece: int = CHUNK_SIZE) -> str:
    sha256 = hashlib.sha256(data).hexdigest()
    await store.blobs.begin_upload(sha256, len(data))
    for offset in range(0, len(data), piece):
        await store.blobs.append_upload(sha256, offset, data[offset : offset + piece])
    await store.blobs.commit_upload(sha256)
    return sha256


@pytest.fixture
async def dir_store(store_url: str, tmp_path: Path, clock: ManualClock) -> AsyncIterator[SqlStateStore]:
    """A store on the backend under test with blob bytes in ``tmp_path/blobs``."""
    async with open_store(store_url, blob_dir=tmp_path / "blobs", clock=clock, auto_migrate=True) as store:
        yield store


@pytest.mark.parametrize("backend", ["sqlite-file", "postgres"], indirect=True)
async def test_small_blobs_are_rows_large_ones_files(
    dir_store: SqlStateStore, store_url: str, tmp_path: Path
) -> None:
    blobs = dir_store.blobs
    small, large, single = await blobs.put_many([SMALL, LARGE, b"one"])
    model = await blobs.put_bytes(b"a small model")
    assert not _file(tmp_path / "blobs", small.sha256).exists()
    assert not _file(tmp_path / "blobs", model.sha256).exists()
    assert _file(tmp_path / "blobs", large.sha256).stat().st_size == len(LARGE)
    assert await _chunk_keys(store_url) == {small.sha256, single.sha256, model.sha256}
    assert await blobs.read(small.sha256) == SMALL
    assert await blobs.read(small.sha256, offset=5, size=3) == b"sss"
    assert b"".join([c async for c in blobs.iter_chunks(small.sha256, chunk_size=1000)]) == SMALL
    assert await blobs.read(large.sha256) == LARGE
    assert await blobs.read(model.sha256) == b"a small model"
    # Deleting and collecting remove the rows too.
    assert await blobs.delete(small.sha256) == len(SMALL)
    with pytest.raises(NotFound):
        await blobs.read(small.sha256)
    assert small.sha256 not in await _chunk_keys(store_url)
    # Stored again after a delete, it is whole again.
    assert (await blobs.put_many([SMALL]))[0] == small
    assert await blobs.read(small.sha256) == SMALL


@pytest.mark.parametrize("backend", ["sqlite-file"], indirect=True)
async def test_a_small_blob_in_a_file_stays_readable(
    dir_store: SqlStateStore, store_url: str, tmp_path: Path
) -> None:
    # Uploads land as files whatever their size, like every blob written before small blobs were rows.
    sha256 = await _upload(dir_store, b"uploaded before")
    assert _file(tmp_path / "blobs", sha256).exists()
    assert sha256 not in await _chunk_keys(store_url)
    assert await dir_store.blobs.read(sha256) == b"uploaded before"
    assert [d async for d in dir_store.blobs.read_each([sha256, sha256])] == [b"uploaded before"] * 2
    # Putting the same content again finds it stored: no row is added next to the file.
    assert (await dir_store.blobs.put_many([b"uploaded before"]))[0].sha256 == sha256
    assert sha256 not in await _chunk_keys(store_url)


async def test_read_each_keeps_order_across_batches(store: SqlStateStore) -> None:
    blobs = store.blobs
    datas = [bytes([i]) * (1000 + i) for i in range(7)] + [THREE_CHUNKS, b""]
    refs = await blobs.put_many(datas)
    shas = [r.sha256 for r in refs]
    order = [shas[3], shas[7], shas[0], shas[0], shas[8], shas[6], shas[1], shas[2], shas[5], shas[4]]
    want = [datas[shas.index(sha)] for sha in order]
    for batch_bytes in (1, 2500, 10_000, 16 * 1024**2):
        got = [d async for d in blobs.read_each(order, batch_bytes=batch_bytes)]
        assert got == want, f"batch_bytes={batch_bytes}"
    assert [d async for d in blobs.read_each([])] == []


async def test_read_each_raises_not_found_where_a_blob_is_missing(store: SqlStateStore) -> None:
    ref = (await store.blobs.put_many([b"here"]))[0]
    missing = hashlib.sha256(b"never stored").hexdigest()
    seen: list[bytes] = []
    with pytest.raises(NotFound):
        async for data in store.blobs.read_each([ref.sha256, missing, ref.sha256], batch_bytes=2):
            seen.append(data)
    assert seen == [b"here"]


async def test_fsync_policy_follows_the_database(store_url: str, backend: str) -> None:
    database = Database(store_url)
    try:
        assert blob_files_need_fsync(database) is (backend == "postgres")
    finally:
        await database.dispose()


@pytest.mark.parametrize("backend", ["sqlite-file", "postgres"], indirect=True)
async def test_upload_fsyncs_its_file_once_at_commit(
    dir_store: SqlStateStore, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    await _upload(dir_store, THREE_CHUNKS, piece=CHUNK_SIZE // 2)
    await dir_store.blobs.put_bytes(LARGE)
    await dir_store.blobs.put_many([b"small", LARGE[::-1]])
    if backend == "postgres":
        # One per file (the upload, put_bytes, put_many's large blob), never per chunk, and each
        # file's directory entry after it is named.
        assert sorted(synced) == ["dir"] * 3 + ["file"] * 3
    else:
        assert synced == []  # SQLite commits are not fsynced either (synchronous=NORMAL)


async def test_put_many_with_the_callers_hashes_stores_the_same_blobs(dir_store: SqlStateStore) -> None:
    datas = [b"hashed by the caller", LARGE]
    shas = [hashlib.sha256(d).hexdigest() for d in datas]
    refs = await dir_store.blobs.put_many(datas, sha256s=shas)
    assert [r.sha256 for r in refs] == shas
    assert [r.size_bytes for r in refs] == [len(d) for d in datas]
    assert [await dir_store.blobs.read(sha) for sha in shas] == datas


async def test_a_ranged_read_of_a_blob_file_closes_it_before_returning(dir_store: SqlStateStore) -> None:
    # A read that stops before the end leaves the chunk generators it walked: they must close their
    # file then, not whenever the garbage collector finds them (a ResourceWarning, or a held fd).
    data = os.urandom(3 * CHUNK_SIZE)
    ref = await dir_store.blobs.put_bytes(data)
    before = len(os.listdir("/proc/self/fd"))
    assert await dir_store.blobs.read(ref.sha256, offset=5, size=10) == data[5:15]
    assert len(os.listdir("/proc/self/fd")) == before
