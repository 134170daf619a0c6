"""Storage over real gRPC and a real store: a device that uploads 1 GiB of junk is held to its upload quota
(RESOURCE_EXHAUSTED with a retry_after) and leaves nothing behind once the collection has run (no blob
rows, upload rows, grants, chunks or files), while everything a finished job uses stays readable; the
events of a long-finished job are trimmed to how it ended.

The collection runs as the coordinator's own background loop, every 50 ms; the windows it collects by
pass on an injected clock, so 1 GiB goes through in seconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import sqlalchemy as sa

from fedlink.common.retry_info import retry_after_of
from fedlink.server.app import Coordinator
from fedlink.server.domain import ManualClock
from fedlink.server.store import SqlStateStore
from fedlink.server.store.schema import blob_chunks, blob_grants, blob_uploads, blobs
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb
from fedlink.v1 import runner_service_pb2_grpc as rgrpc

from .conftest import (
    Metadata,
    StubDevice,
    dense,
    download_model,
    local_settings,
    read_tensor,
    upload_model,
    weights_dxo,
)

MIB = 1024 * 1024
JUNK_BYTES = 1024 * MIB
UPLOAD_BYTES = 16 * MIB
QUOTA_BYTES = 64 * MIB
CHUNK_BYTES = 4 * MIB  # the most one UploadBlob message may carry
SETTINGS: dict[str, Any] = {
    "collection_interval": timedelta(milliseconds=50),
    "unused_blob_ttl": timedelta(hours=1),
    "stale_upload_ttl": timedelta(hours=2),
    "device_upload_quota_bytes": QUOTA_BYTES,
    "finished_job_events_ttl": timedelta(days=1),
}
PAST_EVERY_WINDOW = timedelta(hours=3)
MODEL = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}


def _upload_requests(data: bytes, *, announced: int | None = None) -> Iterator[rpb.UploadBlobRequest]:
    header = dxo_pb2.BlobUploadHeader(
        sha256=hashlib.sha256(data).hexdigest()
        if announced is None
        else hashlib.sha256(b"x" + data).hexdigest(),
        size_bytes=len(data) if announced is None else announced,
    )
    yield rpb.UploadBlobRequest(header=header)
    view = memoryview(data)
    for start in range(0, len(data), CHUNK_BYTES):
        yield rpb.UploadBlobRequest(chunk=bytes(view[start : start + CHUNK_BYTES]))


async def _traces(store: SqlStateStore, blob_dir: Path) -> dict[str, set[str]]:
    """Every place a blob or an upload leaves a trace."""
    async with store.database.read() as conn:
        found = {
            "blob rows": set((await conn.execute(sa.select(blobs.c.sha256))).scalars()),
            "upload rows": set((await conn.execute(sa.select(blob_uploads.c.upload_key))).scalars()),
            "grants": set((await conn.execute(sa.select(blob_grants.c.sha256))).scalars()),
            "chunk rows": set((await conn.execute(sa.select(blob_chunks.c.blob_key).distinct())).scalars()),
        }
    found["files"] = await asyncio.to_thread(lambda: {p.name for p in blob_dir.rglob("*") if p.is_file()})
    return found


async def _until(condition: Any, what: str, timeout_s: float = 10.0) -> None:
    """Waits for the background collection: bounded, so a collection that never comes fails the test."""
    for _ in range(int(timeout_s / 0.02)):
        if await condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{what} within {timeout_s:g} s")


async def _finished_job(
    control: cgrpc.ControlServiceAsyncStub, admin: Metadata, device: StubDevice
) -> tuple[str, set[str]]:
    """Runs a one-round job whose device reports its update as an uploaded blob; returns the job and
    every blob it uses (initial model, task payload, result, global model and checkpoint)."""
    model_sha = await upload_model(control, weights_dxo(MODEL), admin)
    spec = cpb.JobSpec(name="kept", initial_model=dxo_pb2.BlobRef(sha256=model_sha))
    spec.fedavg.CopyFrom(cpb.FedAvgConfig(num_rounds=1, devices_per_round=1, min_results=1))
    spec.fedavg.round_timeout.FromSeconds(60)
    job_id = (
        await control.SubmitJob(cpb.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4())), metadata=admin)
    ).job.job_id
    for _ in range(100):
        await device.get_job("kept")
        task = await device.get_task(job_id, wait_s=0.2)
        if task.status == rpb.RUNNER_STATUS_OK:
            break
    else:
        raise AssertionError("the device was never handed the round's task")
    update = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    update.data["w"].CopyFrom(dense(np.ones((2, 3), np.float32)))
    update.meta["num_examples"].int_value = 10
    data = update.SerializeToString(deterministic=True)
    result_sha = hashlib.sha256(data).hexdigest()
    await device.stub.UploadBlob(_upload_requests(data), metadata=device.metadata)
    request = rpb.ReportResultRequest(
        job_id=job_id,
        task_id=task.task_id,
        cookie=task.cookie,
        status=states_pb2.RESULT_STATUS_SUCCEEDED,
        request_id=str(uuid.uuid4()),
    )
    request.result.blob.sha256, request.result.blob.size_bytes = result_sha, len(data)
    assert (await device.stub.ReportResult(request, metadata=device.metadata)).status == rpb.RUNNER_STATUS_OK
    for _ in range(400):
        job = (await control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=admin)).job
        if job.state == states_pb2.JOB_STATE_FINISHED:
            break
        assert job.state == states_pb2.JOB_STATE_RUNNING, job.message
        await asyncio.sleep(0.05)
    final = read_tensor((await download_model(control, job_id, admin)).data["w"])
    assert final.tolist() == (MODEL["w"] + 1).tolist()
    return job_id, {model_sha, result_sha}


async def _junk(
    address: str, device: StubDevice, clock: ManualClock, store: SqlStateStore
) -> tuple[int, int]:
    """Uploads 1 GiB of junk, complete uploads and abandoned halves, never reporting any; each time the
    quota refuses one, the clock passes every collection window and the collection makes room.
    Returns (bytes sent, refusals).

    Through the synchronous client, in a thread: grpc.aio's client may report INTERNAL ("Internal
    error from Core") instead of the server's status when the server ends a client stream before the
    client has sent it all (grpc/grpc#36066); the synchronous client reports the server's status.
    """
    channel = grpc.insecure_channel(address, options=[("grpc.so_reuseport", 0)])
    stub = rgrpc.RunnerServiceStub(channel)
    try:
        return await _junk_through(stub, device.metadata, clock, store)
    finally:
        channel.close()


async def _junk_through(
    stub: rgrpc.RunnerServiceStub, metadata: Metadata, clock: ManualClock, store: SqlStateStore
) -> tuple[int, int]:
    base = bytearray(os.urandom(UPLOAD_BYTES))
    sent = refusals = n = 0
    while sent < JUNK_BYTES:
        n += 1
        base[:8] = n.to_bytes(8, "big")  # distinct content each time
        data = bytes(base)
        abandoned = n % 3 == 0  # announces the whole, sends half and hangs up
        requests = (
            _upload_requests(data[: UPLOAD_BYTES // 2], announced=UPLOAD_BYTES)
            if abandoned
            else _upload_requests(data)
        )
        try:
            await asyncio.to_thread(stub.UploadBlob, requests, metadata=metadata)
            assert not abandoned
        except grpc.RpcError as error:
            assert isinstance(error, grpc.Call)
            if error.code() == grpc.StatusCode.INVALID_ARGUMENT and abandoned:
                sent += UPLOAD_BYTES // 2  # "the stream ended after ..." : kept, resumable, unused
                continue
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
            assert f"quota of {QUOTA_BYTES} bytes" in (error.details() or "")
            assert retry_after_of(error.trailing_metadata()) == SETTINGS["collection_interval"]
            refusals += 1
            clock.advance(PAST_EVERY_WINDOW)

            async def room() -> bool:
                async with store.database.read() as conn:
                    return not (await conn.execute(sa.select(blob_uploads.c.upload_key))).first()

            await _until(room, "the collection did not free the device's unused uploads")
            continue
        sent += UPLOAD_BYTES
    return sent, refusals


async def test_a_gigabyte_of_junk_leaves_nothing_and_what_jobs_use_stays(tmp_path: Path) -> None:
    clock = ManualClock()
    settings = local_settings(tmp_path, **SETTINGS)
    async with Coordinator(settings, clock=clock) as coordinator:
        assert coordinator.endpoint is not None and coordinator.store is not None
        store, blob_dir = coordinator.store, settings.blob_dir
        admin: Metadata = (("authorization", f"Bearer {coordinator.admin_token}"),)
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
            worker = await StubDevice(channel).enroll()
            job_id, used = await _finished_job(control, admin, worker)
            before = await _traces(store, blob_dir)
            run = await store.get_current_run(job_id)
            used.add(str(run.global_model_sha256))
            assert before["blob rows"] == used, "the job's blobs are not what the test thinks"

            junk = await StubDevice(channel).enroll()
            sent, refusals = await _junk(coordinator.endpoint.address, junk, clock, store)
            assert sent >= JUNK_BYTES and refusals >= JUNK_BYTES // QUOTA_BYTES - 1

            clock.advance(PAST_EVERY_WINDOW)

            async def clean() -> bool:
                return (await _traces(store, blob_dir))["blob rows"] == used

            await _until(clean, "the junk's blobs were not all collected")
            await asyncio.sleep(0.2)  # a few more collections: they must not touch what is used
            after = await _traces(store, blob_dir)
            assert after["blob rows"] == used
            assert after["upload rows"] == set(), "a partial upload or an unused upload's marker stayed"
            assert after["grants"] <= used, "a grant of a junk blob stayed"
            assert after["chunk rows"] <= used and after["files"] <= used, "bytes of junk stayed"
            assert after["files"] | after["chunk rows"] == before["files"] | before["chunk rows"]
            # What the job uses is whole: its final model and each blob read back by their hashes.
            final = read_tensor((await download_model(control, job_id, admin)).data["w"])
            assert final.tolist() == (MODEL["w"] + 1).tolist()
            for sha in used:
                assert hashlib.sha256(await store.blobs.read(sha)).hexdigest() == sha


async def _watch(
    control: cgrpc.ControlServiceAsyncStub, admin: Metadata, job_id: str
) -> list[cpb.WatchJobResponse]:
    stream = control.WatchJob(cpb.WatchJobRequest(job_id=job_id), metadata=admin, timeout=10)
    return [reply async for reply in stream]


async def test_a_long_finished_job_keeps_only_how_it_ended(tmp_path: Path) -> None:
    clock = ManualClock()
    async with Coordinator(local_settings(tmp_path, **SETTINGS), clock=clock) as coordinator:
        assert coordinator.endpoint is not None and coordinator.store is not None
        admin: Metadata = (("authorization", f"Bearer {coordinator.admin_token}"),)
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
            job_id, _ = await _finished_job(control, admin, await StubDevice(channel).enroll())
            events = await _watch(control, admin, job_id)
            assert len(events) > 3 and events[-1].HasField("job_state_changed")
            clock.advance(timedelta(days=1, seconds=1))

            async def trimmed() -> bool:
                return len(await coordinator.store.list_job_events(job_id)) == 1  # type: ignore[union-attr]

            await _until(trimmed, "the finished job's events were not trimmed")
            (last,) = await _watch(control, admin, job_id)
            assert last == events[-1], "the watch of a long-finished job no longer says how it ended"
