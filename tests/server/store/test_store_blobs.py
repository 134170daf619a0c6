"""Contract: content-addressed blobs, stored once, uploaded resumably, checked by sha256, streamed, collected.

The default store keeps bytes in a directory next to a SQLite file and in the database otherwise, so the
three backends cover both blob backends; one more case puts a directory next to PostgreSQL.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from fedlink.common.errors import FailedPrecondition, InvalidArgument, NotFound
from fedlink.server.domain import ManualClock
from fedlink.server.store import CHUNK_SIZE, NewJob, SqlStateStore, open_store

BIG = os.urandom(2 * CHUNK_SIZE + 12345)
BIG_SHA = hashlib.sha256(BIG).hexdigest()


async def test_put_read_and_dedupe(store: SqlStateStore) -> None:
    ref = await store.blobs.put_bytes(b"hello")
    assert ref.sha256 == hashlib.sha256(b"hello").hexdigest() and ref.size_bytes == 5
    again = await store.blobs.put_bytes(b"hello")
    assert again == ref
    assert await store.blobs.read(ref.sha256) == b"hello"
    assert await store.blobs.read(ref.sha256, offset=1, size=3) == b"ell"
    assert (await store.blobs.stat(ref.sha256)).size_bytes == 5
    assert await store.blobs.delete(ref.sha256) == 5
    assert await store.blobs.delete(ref.sha256) == 0
    with pytest.raises(NotFound):
        await store.blobs.read(ref.sha256)


async def test_resumable_chunked_upload(store: SqlStateStore) -> None:
    blobs = store.blobs
    assert await blobs.begin_upload(BIG_SHA, len(BIG)) == 0
    first = CHUNK_SIZE + 100
    assert await blobs.append_upload(BIG_SHA, 0, BIG[:first]) == first
    # The uploader restarts: it asks where to resume, and a wrong offset is refused.
    assert await blobs.begin_upload(BIG_SHA, len(BIG)) == first
    assert await blobs.received_bytes(BIG_SHA) == first
    with pytest.raises(FailedPrecondition, match=str(first)):
        await blobs.append_upload(BIG_SHA, 0, BIG[:10])
    with pytest.raises(FailedPrecondition):
        await blobs.commit_upload(BIG_SHA)
    with pytest.raises(InvalidArgument):
        await blobs.append_upload(BIG_SHA, first, BIG[first:] + b"extra")
    await blobs.append_upload(BIG_SHA, first, BIG[first:])
    ref = await blobs.commit_upload(BIG_SHA)
    assert (ref.sha256, ref.size_bytes) == (BIG_SHA, len(BIG))
    assert await blobs.received_bytes(BIG_SHA) == len(BIG)
    chunks = [c async for c in blobs.iter_chunks(BIG_SHA, offset=7, chunk_size=500_000)]
    assert max(len(c) for c in chunks) <= 500_000
    assert b"".join(chunks) == BIG[7:]
    # Uploading it again is a no-op: the store already has every byte.
    assert await blobs.begin_upload(BIG_SHA, len(BIG)) == len(BIG)


async def test_upload_with_wrong_hash_is_discarded(store: SqlStateStore) -> None:
    claimed = hashlib.sha256(b"what the client promised").hexdigest()
    await store.blobs.begin_upload(claimed, 11)
    await store.blobs.append_upload(claimed, 0, b"not that!!!")
    with pytest.raises(InvalidArgument, match="upload discarded"):
        await store.blobs.commit_upload(claimed)
    assert not await store.blobs.exists(claimed)
    assert await store.blobs.received_bytes(claimed) == 0
    with pytest.raises(InvalidArgument):
        await store.blobs.begin_upload("not-a-sha", 3)


async def test_put_stream_hashes_as_it_goes(store: SqlStateStore) -> None:
    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(BIG), 700_000):
            yield BIG[start : start + 700_000]

    ref = await store.blobs.put_stream(pieces())
    assert (ref.sha256, ref.size_bytes) == (BIG_SHA, len(BIG))
    assert hashlib.sha256(await store.blobs.read(BIG_SHA)).hexdigest() == BIG_SHA
    assert await store.blobs.put_stream(pieces()) == ref


async def test_gc_deletes_only_old_unreferenced_blobs(store: SqlStateStore, clock: ManualClock) -> None:
    kept = await store.blobs.put_bytes(b"initial model")
    await store.create_job(NewJob(name="j", spec_json="{}", job_data="{}", initial_model_sha256=kept.sha256))
    orphan = await store.blobs.put_bytes(b"orphan")
    stale_upload = hashlib.sha256(b"never finished").hexdigest()
    await store.blobs.begin_upload(stale_upload, 14)
    await store.blobs.append_upload(stale_upload, 0, b"never")
    clock.advance(timedelta(hours=2))
    young = await store.blobs.put_bytes(b"just uploaded, not yet referenced")

    freed = await store.blobs.gc_unreferenced(older_than=clock.now() - timedelta(hours=1))
    assert freed == orphan.size_bytes + len(b"never")
    assert not await store.blobs.exists(orphan.sha256)
    assert await store.blobs.exists(kept.sha256) and await store.blobs.exists(young.sha256)
    assert await store.blobs.received_bytes(stale_upload) == 0


@pytest.mark.parametrize("backend", ["postgres", "sqlite-memory"], indirect=True)
async def test_directory_blobs_with_any_database(store_url: str, tmp_path: Path, clock: ManualClock) -> None:
    async with open_store(store_url, blob_dir=tmp_path / "blobs", clock=clock, auto_migrate=True) as store:
        ref = await store.blobs.put_bytes(BIG)
        on_disk = tmp_path / "blobs" / "objects" / BIG_SHA[:2] / BIG_SHA
        assert on_disk.stat().st_size == len(BIG)
        assert await store.blobs.read(ref.sha256, offset=len(BIG) - 5) == BIG[-5:]
        await store.blobs.delete(ref.sha256)
        assert not on_disk.exists()


@pytest.mark.parametrize("backend", ["sqlite-file"], indirect=True)
async def test_sqlite_file_keeps_blobs_next_to_it_or_inside(store_url: str, tmp_path: Path) -> None:
    async with open_store(store_url) as store:
        ref = await store.blobs.put_bytes(BIG)
    assert (tmp_path / "fedlink.db.blobs" / "objects" / ref.sha256[:2] / ref.sha256).exists()
    async with open_store(store_url, blobs_in_database=True) as store:
        inside = await store.blobs.put_bytes(b"y" * 10)
        assert await store.blobs.read(inside.sha256) == b"y" * 10
    assert not (tmp_path / "fedlink.db.blobs" / "objects" / inside.sha256[:2]).exists()
