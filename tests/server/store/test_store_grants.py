"""Contract: proof of possession. Each device's upload is its own, a stored blob is granted only to the
devices that uploaded it whole (or were handed it as a task's input), the bytes are kept once, and
grants go with their blob."""

from __future__ import annotations

import asyncio
import hashlib
import os
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from fedlink.common.errors import FailedPrecondition, InvalidArgument
from fedlink.server.domain import ManualClock
from fedlink.server.store import CHUNK_SIZE, SqlStateStore
from fedlink.server.store.schema import blob_chunks, blob_grants, blob_uploads, blobs
from fedlink.server.store.testing import World

DATA = os.urandom(CHUNK_SIZE + 4321)
SHA = hashlib.sha256(DATA).hexdigest()
LEASE = timedelta(minutes=5)


async def _upload(store: SqlStateStore, owner: str | None, data: bytes, sha: str = SHA) -> None:
    assert await store.blobs.begin_upload(sha, len(data), owner=owner) == 0
    await store.blobs.append_upload(sha, 0, data, owner=owner)
    await store.blobs.commit_upload(sha, owner=owner)


async def _stored(store: SqlStateStore, tmp_path: Path) -> tuple[list[str], list[str], list[str], list[str]]:
    """The blob rows, upload rows, chunk keys in the database and blob files: where bytes could be."""
    async with store.database.read() as conn:
        rows = list((await conn.execute(sa.select(blobs.c.sha256))).scalars())
        uploads = list((await conn.execute(sa.select(blob_uploads.c.upload_key))).scalars())
        keys = list((await conn.execute(sa.select(blob_chunks.c.blob_key).distinct())).scalars())
    files = await asyncio.to_thread(_blob_files, tmp_path)
    return sorted(rows), sorted(uploads), sorted(keys), files


def _blob_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file() and ".blobs" in str(p))


async def _grants(store: SqlStateStore) -> set[tuple[str, str]]:
    async with store.database.read() as conn:
        return {
            (s, d) for s, d in await conn.execute(sa.select(blob_grants.c.sha256, blob_grants.c.device_id))
        }


async def test_a_grant_needs_the_blob_and_is_idempotent(store: SqlStateStore) -> None:
    assert not await store.grant_blob(SHA, "dev-a")
    assert await _grants(store) == set()
    await _upload(store, "dev-a", DATA)
    assert not await store.device_holds_blob("dev-a", SHA)  # the upload alone does not grant
    assert await store.grant_blob(SHA, "dev-a")
    assert await store.grant_blob(SHA, "dev-a")
    assert await _grants(store) == {(SHA, "dev-a")}
    assert await store.device_holds_blob("dev-a", SHA)
    assert not await store.device_holds_blob("dev-b", SHA)


async def test_each_owner_uploads_on_its_own_and_the_bytes_are_kept_once(
    store: SqlStateStore, tmp_path: Path
) -> None:
    b = store.blobs
    # A and B upload the same content at the same time, interleaved: neither sees the other's bytes.
    assert await b.begin_upload(SHA, len(DATA), owner="dev-a") == 0
    assert await b.begin_upload(SHA, len(DATA), owner="dev-b") == 0
    assert await b.append_upload(SHA, 0, DATA[:100], owner="dev-a") == 100
    assert await b.received_bytes(SHA, owner="dev-a") == 100
    assert await b.received_bytes(SHA, owner="dev-b") == 0
    assert await b.received_bytes(SHA) == 0  # nor does an operator's upload of the same hash
    with pytest.raises(FailedPrecondition, match="has 0 bytes"):
        await b.append_upload(SHA, 100, DATA[100:], owner="dev-b")
    assert await b.append_upload(SHA, 0, DATA[:7], owner="dev-b") == 7
    # A resumes where it stopped (a new stream asks begin_upload), finishes and commits first.
    assert await b.begin_upload(SHA, len(DATA), owner="dev-a") == 100
    await b.append_upload(SHA, 100, DATA[100:], owner="dev-a")
    ref = await b.commit_upload(SHA, owner="dev-a")
    assert (ref.sha256, ref.size_bytes) == (SHA, len(DATA))
    # The blob is stored, yet B's own upload still reads as B's bytes, not as complete.
    assert await b.received_bytes(SHA, owner="dev-b") == 7
    assert await b.begin_upload(SHA, len(DATA), owner="dev-b") == 7
    with pytest.raises(FailedPrecondition, match="7 of"):
        await b.commit_upload(SHA, owner="dev-b")
    await b.append_upload(SHA, 7, DATA[7:], owner="dev-b")
    assert await b.commit_upload(SHA, owner="dev-b") == ref
    rows, uploads, keys, files = await _stored(store, tmp_path)
    # No upload is in flight; each owner's complete upload stays marked as held, unused (no bytes).
    assert rows == [SHA] and [key[:3] for key in uploads] == ["uh-", "uh-"]
    assert keys + files == [SHA]  # one copy of the bytes, wherever the backend keeps them
    assert await b.read(SHA) == DATA


async def test_an_owner_upload_of_other_bytes_is_discarded_even_if_the_blob_is_stored(
    store: SqlStateStore, tmp_path: Path
) -> None:
    await _upload(store, "dev-a", DATA)
    forged = bytes(len(DATA))
    assert await store.blobs.begin_upload(SHA, len(DATA), owner="dev-b") == 0
    await store.blobs.append_upload(SHA, 0, forged, owner="dev-b")
    with pytest.raises(InvalidArgument, match="upload discarded"):
        await store.blobs.commit_upload(SHA, owner="dev-b")
    assert await store.blobs.received_bytes(SHA, owner="dev-b") == 0
    rows, uploads, keys, files = await _stored(store, tmp_path)
    assert rows == [SHA] and [key[:3] for key in uploads] == ["uh-"]  # A's, held; B's is gone
    assert keys + files == [SHA]
    assert await store.blobs.read(SHA) == DATA


async def test_grants_go_with_their_blob(store: SqlStateStore, clock: ManualClock) -> None:
    other = await store.blobs.put_bytes(b"another device's update")
    await _upload(store, "dev-a", DATA)
    for sha, device in ((SHA, "dev-a"), (SHA, "dev-b"), (other.sha256, "dev-b")):
        assert await store.grant_blob(sha, device)
    assert await store.blobs.delete(SHA) == len(DATA)
    assert await _grants(store) == {(other.sha256, "dev-b")}
    assert not await store.device_holds_blob("dev-a", SHA)
    clock.advance(timedelta(hours=2))
    assert await store.blobs.gc_unreferenced(older_than=clock.now() - timedelta(hours=1)) > 0
    assert await _grants(store) == set()


async def test_a_task_input_is_held_by_the_devices_it_was_handed_to(world: World) -> None:
    store = world.store
    model = await store.blobs.put_bytes(b"global model")
    d0, d1 = world.devices[0].device_id, world.devices[1].device_id
    await world.tasks(1, targets=[d0, d1], slots=2, payload_sha256=model.sha256)
    assert not await store.device_holds_blob(d0, model.sha256)  # offered, not handed yet
    assert await store.claim_task(d0, world.job.job_id, world.clock.now(), LEASE) is not None
    # The same rule as downloads: handed, so held.
    assert await store.device_holds_blob(d0, model.sha256)
    assert await store.device_may_read_blob(d0, model.sha256)
    assert not await store.device_holds_blob(d1, model.sha256)
    assert not await store.device_may_read_blob(d1, model.sha256)
    assert await _grants(store) == set()  # handing out a task writes no grant
