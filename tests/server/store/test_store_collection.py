"""Contract: collection deletes what nothing uses (blobs, idle uploads, refused payloads, old job events)
with every byte of it, and never what a job, run, task, result or checkpoint uses; a device's unused
uploads are bounded by its quota.

The three backends cover both blob backends (files next to a SQLite file; chunk rows otherwise).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from fedlink.common.errors import Conflict, ResourceExhausted
from fedlink.server.domain import Assignment, JobState, ManualClock, ResultStatus
from fedlink.server.store import CHUNK_SIZE, NewJob, ResultReport, SqlStateStore, UploadQuota
from fedlink.server.store.schema import blob_chunks, blob_grants, blob_uploads, blobs
from fedlink.server.store.testing import World

TTL = timedelta(hours=1)
IDLE = timedelta(hours=24)
LEASE = timedelta(minutes=5)


def _data(tag: str, size: int = 100) -> bytes:
    """Distinct bytes per tag: ``size`` large enough makes a file (directory backend) or many chunks."""
    seed = hashlib.sha256(tag.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


BIG = 2 * CHUNK_SIZE + 999  # files next to SQLite, several chunk rows in the database


async def _everything(store: SqlStateStore, root: Path) -> dict[str, set[str]]:
    """Every place a blob or upload leaves a trace: rows, upload rows, chunk keys, grants, files."""
    async with store.database.read() as conn:
        found = {
            "blobs": set((await conn.execute(sa.select(blobs.c.sha256))).scalars()),
            "uploads": set((await conn.execute(sa.select(blob_uploads.c.upload_key))).scalars()),
            "chunks": set((await conn.execute(sa.select(blob_chunks.c.blob_key).distinct())).scalars()),
            "grants": set((await conn.execute(sa.select(blob_grants.c.sha256))).scalars()),
        }
    found["files"] = await asyncio.to_thread(
        lambda: {p.name for p in root.rglob("*") if p.is_file() and ".blobs" in str(p)}
    )
    return found


async def _collect(store: SqlStateStore, clock: ManualClock) -> int:
    now = clock.now()
    collected = await store.blobs.collect(unused_before=now - TTL, idle_uploads_before=now - IDLE)
    return collected.total_bytes


async def _upload(store: SqlStateStore, data: bytes, owner: str | None = None) -> str:
    sha = hashlib.sha256(data).hexdigest()
    await store.blobs.begin_upload(sha, len(data), owner=owner)
    await store.blobs.append_upload(sha, 0, data, owner=owner)
    await store.blobs.commit_upload(sha, owner=owner)
    if owner is not None:
        assert await store.grant_blob(sha, owner)
    return sha


async def _claim(world: World, index: int) -> Assignment:
    held = await world.store.claim_task(
        world.devices[index].device_id, world.job.job_id, world.clock.now(), LEASE
    )
    assert held is not None
    return held


def _report(held: Assignment, sha: str | None, *, request_id: str = "r1") -> ResultReport:
    return ResultReport(
        assignment_id=held.assignment_id,
        device_id=held.device_id,
        status=ResultStatus.SUCCEEDED,
        payload_sha256=sha,
        report_digest=f"digest-{sha}",
        request_id=request_id,
        error_message="",
    )


async def test_collection_deletes_every_trace_of_unused_blobs_and_nothing_in_use(
    world: World, tmp_path: Path
) -> None:
    store, clock = world.store, world.clock
    used = {
        "initial model": (await store.blobs.put_bytes(_data("initial", BIG))).sha256,
        "task payload": (await store.blobs.put_bytes(_data("task"))).sha256,
        "checkpoint model": (await store.blobs.put_bytes(_data("model", BIG))).sha256,
        "workflow state": (await store.blobs.put_bytes(_data("state"))).sha256,
        "reported upload": await _upload(store, _data("upload", BIG), world.devices[1].device_id),
    }
    await store.create_job(
        NewJob(name="j2", spec_json="{}", job_data="{}", initial_model_sha256=used["initial model"])
    )
    await world.tasks(2, payload_sha256=used["task payload"])
    await store.save_checkpoint(
        world.run.run_id, 1, used["checkpoint model"], "[]", keep_last=1, state_sha256=used["workflow state"]
    )
    inline = _data("inline result")
    used["inline result"] = hashlib.sha256(inline).hexdigest()
    first, second = await _claim(world, 0), await _claim(world, 1)
    outcomes = await store.record_results(
        [_report(first, used["inline result"]), _report(second, used["reported upload"])],
        clock.now(),
        payloads=[(used["inline result"], inline)],
    )
    assert all(not isinstance(o, Exception) and o.result.accepted for o in outcomes)
    unused = {
        "orphan": (await store.blobs.put_bytes(_data("orphan"))).sha256,
        "big orphan": (await store.blobs.put_bytes(_data("big orphan", BIG))).sha256,
        "never submitted": await _upload(store, _data("operator upload", BIG)),
        "never reported": await _upload(store, _data("junk", BIG), world.devices[2].device_id),
        "never reported, small": await _upload(store, _data("small junk"), world.devices[2].device_id),
    }
    before = await _everything(store, tmp_path)
    assert set(unused.values()) <= before["blobs"]

    clock.advance(TTL - timedelta(seconds=1))
    young = (await store.blobs.put_bytes(_data("young orphan"))).sha256
    assert await _collect(store, clock) == 0  # nothing is old enough yet
    clock.advance(timedelta(seconds=2))
    freed = await _collect(store, clock)

    after = await _everything(store, tmp_path)
    assert after["blobs"] == set(used.values()) | {young}, "an unused blob was kept or a used one deleted"
    assert freed == sum(len(d) for d in [_data("orphan"), _data("small junk")]) + 3 * BIG
    assert after["uploads"] == set(), "an unused upload's marker was kept"
    assert after["grants"] <= after["blobs"]
    # No byte of a deleted blob is left anywhere: chunk rows and files name only blobs still stored.
    assert after["chunks"] <= after["blobs"] and after["files"] <= after["blobs"]
    for name, sha in used.items():
        assert hashlib.sha256(await store.blobs.read(sha)).hexdigest() == sha, f"the {name} lost bytes"
    # Later collections look at what became old since: the young orphan goes in its turn.
    clock.advance(TTL)
    assert await _collect(store, clock) == len(_data("young orphan"))
    assert (await _everything(store, tmp_path))["blobs"] == set(used.values())


async def test_a_partial_upload_goes_once_idle_not_while_bytes_arrive(
    store: SqlStateStore, clock: ManualClock, tmp_path: Path
) -> None:
    data = _data("slow upload", BIG)
    sha = hashlib.sha256(data).hexdigest()
    await store.blobs.begin_upload(sha, len(data), owner="dev-a")
    await store.blobs.append_upload(sha, 0, data[:1000], owner="dev-a")
    clock.advance(IDLE - timedelta(hours=1))
    await store.blobs.append_upload(sha, 1000, data[1000:2000], owner="dev-a")  # still going
    clock.advance(IDLE - timedelta(hours=1))
    assert await _collect(store, clock) == 0
    assert await store.blobs.received_bytes(sha, owner="dev-a") == 2000
    clock.advance(timedelta(hours=2))
    assert await _collect(store, clock) == 2000
    assert await store.blobs.received_bytes(sha, owner="dev-a") == 0
    left = await _everything(store, tmp_path)
    assert left["uploads"] == left["chunks"] == left["files"] == set(), "the idle upload left bytes behind"


async def test_refused_and_late_reports_leave_no_payload(world: World, tmp_path: Path) -> None:
    store, clock = world.store, world.clock
    await world.tasks(3)
    payloads = {name: _data(name) for name in ("accepted", "late", "first", "conflicting")}
    sha = {name: hashlib.sha256(data).hexdigest() for name, data in payloads.items()}
    late, conflicting = await _claim(world, 0), await _claim(world, 1)
    await store.record_result(_report(conflicting, sha["first"], request_id="c1"), clock.now())
    clock.advance(LEASE + timedelta(seconds=1))  # the late one's lease lapses
    accepted = await _claim(world, 2)
    outcomes = await store.record_results(
        [
            _report(accepted, sha["accepted"]),
            _report(late, sha["late"]),
            _report(conflicting, sha["conflicting"], request_id="c2"),
        ],
        clock.now(),
        payloads=[(sha[n], payloads[n]) for n in ("accepted", "late", "conflicting")],
    )
    assert [type(o).__name__ for o in outcomes] == ["RecordOutcome", "RecordOutcome", "Conflict"]
    assert not isinstance(outcomes[0], Exception) and outcomes[0].result.accepted
    assert not isinstance(outcomes[1], Exception) and outcomes[1].result.stale
    assert isinstance(outcomes[2], Conflict)
    # At once, no collection needed: only the accepted payload is stored (the first report had none).
    left = await _everything(store, tmp_path)
    assert left["blobs"] == {sha["accepted"]}
    assert left["chunks"] | left["files"] <= {sha["accepted"]}


async def test_storing_a_blob_again_keeps_it_from_collection(
    world: World, clock: ManualClock, tmp_path: Path
) -> None:
    store = world.store
    small, big, batch, upload, model = (
        _data(n, s) for n, s in [("a", 10), ("b", BIG), ("c", 9), ("d", BIG), ("e", 8)]
    )
    for data in (small, big, batch, upload, model):
        await store.blobs.put_bytes(data)
    clock.advance(2 * TTL)
    # Each is stored again just before the collection, as a user is about to point at it.
    await store.blobs.put_bytes(small)
    await store.blobs.put_bytes(big)
    await store.blobs.put_many([batch])
    await _upload(store, upload, world.devices[0].device_id)
    model_sha = hashlib.sha256(model).hexdigest()
    await store.create_job(NewJob(name="late", spec_json="{}", job_data="{}", initial_model_sha256=model_sha))
    assert await _collect(store, clock) == 0
    stored = (await _everything(store, tmp_path))["blobs"]
    assert stored == {hashlib.sha256(d).hexdigest() for d in (small, big, batch, upload, model)}


async def test_upload_quota_counts_uploads_in_flight_and_complete_ones_not_reported(world: World) -> None:
    store, blobs_ = world.store, world.store.blobs
    quota = UploadQuota(max_bytes=1000, retry_after=timedelta(minutes=10))
    a, b = world.devices[0].device_id, world.devices[1].device_id
    first, second, third = _data("first", 600), _data("second", 500), _data("third", 450)
    sha = {d: hashlib.sha256(d).hexdigest() for d in (first, second, third)}
    assert await blobs_.begin_upload(sha[first], len(first), owner=a, quota=quota) == 0
    with pytest.raises(ResourceExhausted, match=f"device {a} holds 600 bytes.*quota of 1000") as refused:
        await blobs_.begin_upload(sha[second], len(second), owner=a, quota=quota)
    assert refused.value.retry_after == timedelta(minutes=10)
    assert await blobs_.begin_upload(sha[second], len(second), owner=b, quota=quota) == 0  # B's own
    await blobs_.append_upload(sha[first], 0, first[:100], owner=a)
    assert await blobs_.begin_upload(sha[first], len(first), owner=a, quota=quota) == 100  # resumed
    await blobs_.append_upload(sha[first], 100, first[100:], owner=a)
    await blobs_.commit_upload(sha[first], owner=a)
    assert await store.grant_blob(sha[first], a)
    # Complete but not reported: it still counts.
    with pytest.raises(ResourceExhausted):
        await blobs_.begin_upload(sha[third], len(third), owner=a, quota=quota)
    # Reported as an accepted result, it is used: the quota has room again.
    await world.tasks(1)
    held = await _claim(world, 0)
    (outcome,) = await store.record_results([_report(held, sha[first])], world.clock.now())
    assert not isinstance(outcome, Exception) and outcome.result.accepted
    assert await blobs_.begin_upload(sha[third], len(third), owner=a, quota=quota) == 0
    # A complete upload never reported stops counting once collected.
    await blobs_.append_upload(sha[third], 0, third, owner=a)
    await blobs_.commit_upload(sha[third], owner=a)
    with pytest.raises(ResourceExhausted):
        await blobs_.begin_upload(sha[second], len(second) + 200, owner=a, quota=quota)
    world.clock.advance(TTL + timedelta(seconds=1))
    await _collect(store, world.clock)
    assert not await blobs_.exists(sha[third]) and await blobs_.exists(sha[first])
    assert await blobs_.begin_upload(sha[second], len(second), owner=a, quota=quota) == 0


async def test_finished_jobs_keep_their_newest_events_and_running_ones_all(
    store: SqlStateStore, clock: ManualClock
) -> None:
    jobs = {}
    for name in ("running", "just finished", "long finished"):
        job = await store.create_job(NewJob(name=name, spec_json="{}", job_data="{}"))
        await store.set_job_state(job.job_id, JobState.RUNNING)
        for i in range(20):
            await store.append_job_event(job.job_id, "round_closed", f'{{"round": {i}}}')
        jobs[name] = job.job_id
    await store.set_job_state(jobs["long finished"], JobState.FINISHED)
    clock.advance(timedelta(days=31))
    await store.set_job_state(jobs["just finished"], JobState.FAILED, "round 3 got 0 of 2 results")
    deleted = await store.prune_job_events(finished_before=clock.now() - timedelta(days=30), keep_per_job=5)
    assert deleted == 15 + 19

    async def sequences(name: str) -> list[int]:
        return [e.sequence for e in await store.list_job_events(jobs[name])]

    assert await sequences("running") == list(range(1, 21)), "a running job lost events job watch needs"
    assert await sequences("just finished") == list(range(16, 21))
    assert await sequences("long finished") == [20]
    assert await store.prune_job_events(finished_before=clock.now() - timedelta(days=30), keep_per_job=5) == 0


@pytest.mark.parametrize("backend", ["sqlite-file"], indirect=True)
async def test_files_no_row_names_go_once_old(
    store: SqlStateStore, clock: ManualClock, tmp_path: Path
) -> None:
    root = tmp_path / "fedlink.db.blobs"
    kept = await store.blobs.put_bytes(_data("kept", BIG))
    ghost = hashlib.sha256(b"a crash wrote me").hexdigest()
    old = [
        root / "objects" / ghost[:2] / ghost,
        root / "objects" / ghost[:2] / f".{ghost}.123.partial",
        root / "uploads" / "put-0123456789abcdef",
    ]
    fresh = root / "uploads" / "put-fedcba9876543210"
    for path in [*old, fresh]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"leftover")
    long_ago = time.time() - 2 * IDLE.total_seconds()
    for path in [*old, root / "objects" / kept.sha256[:2] / kept.sha256]:
        os.utime(path, (long_ago, long_ago))
    collected = await store.blobs.collect(
        unused_before=clock.now() - TTL, idle_uploads_before=clock.now() - IDLE
    )
    assert collected.orphan_files == 2 and not any(p.exists() for p in old)
    assert fresh.exists(), "a file being written now is no orphan yet"
    assert await store.blobs.read(kept.sha256) == _data("kept", BIG)
