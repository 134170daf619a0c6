"""Integrity over real gRPC and a real store: a model blob damaged on disk between two coordinator starts
(four bytes overwritten in place, so that a weight reads 12345.0, or the blob truncated) fails its job
with a message naming the blob, is logged at ERROR, and is never handed out: DownloadModel and
DownloadBlob answer DATA_LOSS without sending a byte.

The damaged blob is the job's initial model (a file: it came through UploadModel) or the global model
of its first round (a row of the database: a small blob written by the workflow).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import struct
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedlink.server.app import Coordinator
from fedlink.server.settings import CoordinatorSettings
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import Metadata, StubDevice, dense, local_settings, upload_model, weights_dxo

MODEL = {"w": np.array([0.5, 1.0, 1.5, 2.0, 1.25, 0.75], dtype=np.float32)}
WEIGHT = struct.pack("<f", 1.5)  # a weight of the initial model and of round 1's model (+0.0)


def overwrite_a_weight(data: bytes) -> bytes:
    """Four bytes in place: the weight 1.5 reads 12345.0; the length stays."""
    assert data.count(WEIGHT) == 1
    return data.replace(WEIGHT, struct.pack("<f", 12345.0))


def truncate(data: bytes) -> bytes:
    """The last four bytes are gone."""
    return data[:-4]


Damage = Callable[[bytes], bytes]


def _damage_blob(settings: CoordinatorSettings, sha: str, damage: Damage) -> str:
    """Damages the stored bytes of ``sha`` where they are, with no coordinator running; says where."""
    path = settings.blob_dir / "objects" / sha[:2] / sha
    if path.exists():
        path.write_bytes(damage(path.read_bytes()))
        return "file"
    with sqlite3.connect(settings.data_dir / "fedlink.db") as db:
        ((data,),) = db.execute("SELECT data FROM blob_chunks WHERE blob_key = ?", (sha,)).fetchall()
        db.execute("UPDATE blob_chunks SET data = ? WHERE blob_key = ?", (damage(bytes(data)), sha))
    return "row"


async def _task(device: StubDevice, job_id: str, name: str) -> rpb.GetTaskResponse:
    for _ in range(100):
        await device.get_job(name)
        task = await device.get_task(job_id, wait_s=0.2)
        if task.status == rpb.RUNNER_STATUS_OK:
            return task
    raise AssertionError(f"device {device.device_id} was never handed a task of {name}")


def _update() -> dxo_pb2.Dxo:
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    dxo.data["w"].CopyFrom(dense(np.zeros(6, np.float32)))
    dxo.meta["num_examples"].int_value = 4
    return dxo


async def _job(control: cgrpc.ControlServiceAsyncStub, admin: Metadata, job_id: str) -> cpb.Job:
    return (await control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=admin)).job


async def _first_run(settings: CoordinatorSettings, *, until_round: int) -> tuple[str, str, str]:
    """Runs a 3-round job until its device holds the task of ``until_round`` (rounds before it done),
    then stops; returns the job, the device's credential and the blob that task carries."""
    async with Coordinator(settings) as coordinator:
        assert coordinator.endpoint is not None
        admin: Metadata = (("authorization", f"Bearer {coordinator.admin_token}"),)
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
            device = await StubDevice(channel).enroll()
            sha = await upload_model(control, weights_dxo(MODEL), admin)
            spec = cpb.JobSpec(name="integrity", initial_model=dxo_pb2.BlobRef(sha256=sha))
            spec.fedavg.CopyFrom(cpb.FedAvgConfig(num_rounds=3, devices_per_round=1, min_results=1))
            spec.fedavg.round_timeout.FromSeconds(120)
            request = cpb.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4()))
            job_id = (await control.SubmitJob(request, metadata=admin)).job.job_id
            for _ in range(1, until_round):
                task = await _task(device, job_id, "integrity")
                assert (await device.report(job_id, task, _update())).status == rpb.RUNNER_STATUS_OK
            task = await _task(device, job_id, "integrity")
            assert task.task_data.WhichOneof("location") == "blob", "the model must travel as a blob"
            assert (await _job(control, admin, job_id)).state == states_pb2.JOB_STATE_RUNNING
            return job_id, device.metadata[0][1], task.task_data.blob.sha256


@pytest.mark.parametrize("damage", [overwrite_a_weight, truncate], ids=lambda d: d.__name__)
@pytest.mark.parametrize(
    ("until_round", "where"), [(1, "file"), (2, "row")], ids=["initial model", "round 1 model"]
)
async def test_a_model_damaged_between_two_starts_fails_its_job_and_is_never_handed_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Damage, until_round: int, where: str
) -> None:
    # Models travel as blobs (DownloadBlob), not inline in GetTask.
    settings = local_settings(tmp_path, inline_payload_bytes=16, reaper_interval=timedelta(milliseconds=100))
    job_id, bearer, sha = await _first_run(settings, until_round=until_round)
    assert _damage_blob(settings, sha, damage) == where

    with caplog.at_level(logging.ERROR):
        async with Coordinator(settings) as coordinator:
            assert coordinator.endpoint is not None
            admin: Metadata = (("authorization", f"Bearer {coordinator.admin_token}"),)
            async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
                control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
                for _ in range(200):
                    job = await _job(control, admin, job_id)
                    if job.state != states_pb2.JOB_STATE_RUNNING:
                        break
                    await asyncio.sleep(0.05)
                assert job.state == states_pb2.JOB_STATE_FAILED, states_pb2.JobState.Name(job.state)
                assert f"blob {sha} is corrupted" in job.message, job.message

                received: list[bytes] = []
                downloads: dict[str, AsyncIterator[cpb.DownloadModelResponse | rpb.DownloadBlobResponse]] = {
                    "DownloadModel": aiter(
                        control.DownloadModel(
                            cpb.DownloadModelRequest(job_id=job_id), metadata=admin, timeout=10
                        )
                    ),
                    "DownloadBlob": aiter(
                        StubDevice(channel).stub.DownloadBlob(
                            rpb.DownloadBlobRequest(sha256=sha),
                            metadata=(("authorization", bearer),),
                            timeout=10,
                        )
                    ),
                }
                for name, stream in downloads.items():
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        async for chunk in stream:
                            received.append(chunk.data)
                    assert refused.value.code() == grpc.StatusCode.DATA_LOSS, (name, refused.value.details())
                    assert sha in (refused.value.details() or ""), name
                assert received == [], "bytes of the damaged blob were handed out"

    logged = [r for r in caplog.records if r.levelno >= logging.ERROR and sha in r.getMessage()]
    assert logged, "the damaged blob was not logged at ERROR"
    assert "corrupted" in logged[0].getMessage()


async def test_a_damaged_blob_a_device_reads_first_fails_the_job_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = local_settings(tmp_path, inline_payload_bytes=16, reaper_interval=timedelta(milliseconds=100))
    job_id, bearer, sha = await _first_run(settings, until_round=2)
    _damage_blob(settings, sha, overwrite_a_weight)
    # Another coordinator takes over: it waits for the first one's lease on the run (30 s) before its
    # workflow reads anything, so the device's download is the first read of the damaged model.
    (settings.data_dir / "coordinator-id").unlink()
    with caplog.at_level(logging.ERROR):
        async with Coordinator(settings) as coordinator:
            assert coordinator.endpoint is not None
            admin: Metadata = (("authorization", f"Bearer {coordinator.admin_token}"),)
            async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
                control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
                assert (await _job(control, admin, job_id)).state == states_pb2.JOB_STATE_RUNNING
                stream = StubDevice(channel).stub.DownloadBlob(
                    rpb.DownloadBlobRequest(sha256=sha), metadata=(("authorization", bearer),), timeout=10
                )
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in stream:
                        raise AssertionError("a chunk of the damaged blob was handed out")
                assert refused.value.code() == grpc.StatusCode.DATA_LOSS
                for _ in range(100):  # seconds, not the 30 s the lease would take
                    job = await _job(control, admin, job_id)
                    if job.state != states_pb2.JOB_STATE_RUNNING:
                        break
                    await asyncio.sleep(0.05)
                assert job.state == states_pb2.JOB_STATE_FAILED, states_pb2.JobState.Name(job.state)
                assert f"blob {sha} is corrupted" in job.message
    assert [r for r in caplog.records if r.levelno >= logging.ERROR and sha in r.getMessage()]
