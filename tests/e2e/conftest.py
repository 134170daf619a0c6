"""Helpers for end-to-end tests: a device client written against the generated stubs only."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from fedlink.server.settings import CoordinatorSettings
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb
from fedlink.v1 import runner_service_pb2_grpc as rgrpc


def local_settings(tmp_path: Path, **overrides: Any) -> CoordinatorSettings:
    """Settings for a test's coordinator: data in ``tmp_path``, any loopback port, no TLS, open enrolment."""
    defaults: dict[str, Any] = {
        "data_dir": tmp_path / "data",
        "listen_address": "127.0.0.1:0",
        "insecure": True,
        "open_enrolment": True,
    }
    return CoordinatorSettings(**(defaults | overrides))


def dense(array: np.ndarray) -> dxo_pb2.Tensor:
    """A dense little-endian wire tensor, built by hand as another language's client would."""
    a = np.ascontiguousarray(array)
    return dxo_pb2.Tensor(
        dtype=a.dtype.name,
        shape=list(a.shape),
        dense=dxo_pb2.DenseEncoding(data=a.astype(a.dtype.newbyteorder("<")).tobytes()),
    )


def weights_dxo(model: dict[str, np.ndarray]) -> dxo_pb2.Dxo:
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHTS)
    for name, array in model.items():
        dxo.data[name].CopyFrom(dense(array))
    return dxo


def read_tensor(tensor: dxo_pb2.Tensor) -> np.ndarray:
    return np.frombuffer(tensor.dense.data, dtype=np.dtype(tensor.dtype).newbyteorder("<")).reshape(
        tuple(tensor.shape)
    )


Metadata = tuple[tuple[str, str], ...]


async def upload_model(control: cgrpc.ControlServiceAsyncStub, dxo: dxo_pb2.Dxo, metadata: Metadata) -> str:
    data = dxo.SerializeToString(deterministic=True)
    sha = hashlib.sha256(data).hexdigest()

    def parts() -> Iterator[cpb.UploadModelRequest]:
        yield cpb.UploadModelRequest(
            header=dxo_pb2.BlobUploadHeader(sha256=sha, size_bytes=len(data), offset=0)
        )
        for start in range(0, len(data), 64 * 1024):
            yield cpb.UploadModelRequest(chunk=data[start : start + 64 * 1024])

    reply = await control.UploadModel(parts(), metadata=metadata)
    assert reply.model.sha256 == sha
    return sha


async def download_model(
    control: cgrpc.ControlServiceAsyncStub, job_id: str, metadata: Metadata, round: int = 0
) -> dxo_pb2.Dxo:
    stream = control.DownloadModel(cpb.DownloadModelRequest(job_id=job_id, round=round), metadata=metadata)
    chunks = [c.data async for c in stream]
    return dxo_pb2.Dxo.FromString(b"".join(chunks))


class StubDevice:
    """A device speaking RunnerService through the generated stubs, nothing of fedlink's runner."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub: rgrpc.RunnerServiceAsyncStub = rgrpc.RunnerServiceStub(channel)
        self.device_id = ""
        self.metadata: Metadata = ()

    async def enroll(self, *, join_secret: str = "", info: dict[str, str] | None = None) -> StubDevice:
        reply = await self.stub.Enroll(
            rpb.EnrollRequest(
                join_secret=join_secret,
                device_info=info or {"platform": "test"},
                protocol_version="1.0",
                request_id=str(uuid.uuid4()),
            )
        )
        self.device_id = reply.device_id
        self.metadata = (("authorization", f"Bearer {reply.device_credential}"),)
        return self

    async def get_job(self, name: str = "") -> rpb.GetJobResponse:
        request = rpb.GetJobRequest(job_name=name, protocol_version="1.0")
        return await self.stub.GetJob(request, metadata=self.metadata)

    async def get_task(self, job_id: str, cookie: bytes = b"", wait_s: float = 5.0) -> rpb.GetTaskResponse:
        request = rpb.GetTaskRequest(job_id=job_id, cookie=cookie)
        request.wait_timeout.FromMilliseconds(int(wait_s * 1000))
        return await self.stub.GetTask(request, metadata=self.metadata)

    async def report(
        self,
        job_id: str,
        task: rpb.GetTaskResponse,
        dxo: dxo_pb2.Dxo | None,
        *,
        request_id: str | None = None,
    ) -> rpb.ReportResultResponse:
        request = rpb.ReportResultRequest(
            job_id=job_id,
            task_id=task.task_id,
            cookie=task.cookie,
            status=states_pb2.RESULT_STATUS_SUCCEEDED if dxo is not None else states_pb2.RESULT_STATUS_FAILED,
            request_id=request_id or str(uuid.uuid4()),
            error_message="" if dxo is not None else "executor raised",
        )
        if dxo is not None:
            request.result.dxo.CopyFrom(dxo)
        return await self.stub.ReportResult(request, metadata=self.metadata)
