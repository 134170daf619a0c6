"""Operator-side steps of the protocol benchmark: models on disk, upload, job submission, round checks.

Everything goes through the generated ControlService stubs, as an operator's tool would.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2

Metadata = tuple[tuple[str, str], ...]
UPLOAD_CHUNK_BYTES = 1024 * 1024
_FINAL_STATES = frozenset(
    {states_pb2.JOB_STATE_FINISHED, states_pb2.JOB_STATE_FAILED, states_pb2.JOB_STATE_ABORTED}
)


def admin_metadata(token: str) -> Metadata:
    """The call metadata carrying the admin credential."""
    return (("authorization", f"Bearer {token}"),)


@dataclass(frozen=True, slots=True)
class ModelFile:
    """A serialized WEIGHTS ``Dxo`` on disk, with its identity."""

    path: Path
    sha256: str
    size_bytes: int


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, payload_length: int) -> bytes:
    """The tag and length of a length-delimited field."""
    return _varint(number << 3 | 2) + _varint(payload_length)


def dxo_prefix(name: str, elements: int) -> bytes:
    """The bytes of a one-tensor float32 WEIGHTS ``Dxo`` up to where the tensor's data begins.

    The tensor's ``elements * 4`` bytes follow it directly (the data field is the last one), so a
    model of any size is written without ever building the message in memory. The layout is what
    ``SerializeToString(deterministic=True)`` gives, which :func:`small_model_bytes` checks in tests.
    """
    data_length = elements * 4
    dense = _field(1, data_length)  # DenseEncoding.data
    shape = _varint(elements)
    tensor = (
        _field(1, 7)
        + b"float32"  # Tensor.dtype
        + _field(2, len(shape))
        + shape  # Tensor.shape, packed
        + _field(3, len(dense) + data_length)  # Tensor.dense
    )
    tensor_length = len(tensor) + len(dense) + data_length
    key = _field(1, len(name)) + name.encode()
    entry = key + _field(2, tensor_length)  # map entry: key, value
    entry_length = len(entry) + tensor_length
    kind = _varint(1 << 3 | 0) + _varint(dxo_pb2.DATA_KIND_WEIGHTS)
    return kind + _field(2, entry_length) + entry + tensor + dense


def write_model_file(
    path: Path, elements: int, *, seed: int = 0, block_elements: int = 16 * 1024**2
) -> ModelFile:
    """Writes a one-tensor float32 WEIGHTS model of ``elements`` values, block by block (64 MiB)."""
    rng = np.random.default_rng(seed)
    digest = hashlib.sha256()
    with path.open("wb") as out:
        prefix = dxo_prefix("w", elements)
        out.write(prefix)
        digest.update(prefix)
        written = 0
        while written < elements:
            block = rng.standard_normal(min(block_elements, elements - written), dtype=np.float32)
            data = block.astype("<f4", copy=False).tobytes()
            out.write(data)
            digest.update(data)
            written += block.size
    return ModelFile(path=path, sha256=digest.hexdigest(), size_bytes=path.stat().st_size)


def small_model_bytes(elements: int) -> bytes:
    """A one-tensor float32 WEIGHTS ``Dxo`` built with the generated message (for small models)."""
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHTS)
    tensor = dxo.data["w"]
    tensor.dtype = "float32"
    tensor.shape.append(elements)
    tensor.dense.data = np.arange(elements, dtype="<f4").tobytes()
    return dxo.SerializeToString(deterministic=True)


async def upload_model(control: cgrpc.ControlServiceAsyncStub, metadata: Metadata, model: ModelFile) -> None:
    """Uploads a model file in 1 MiB chunks, never holding more than one chunk."""

    async def parts() -> AsyncIterator[cpb.UploadModelRequest]:
        yield cpb.UploadModelRequest(
            header=dxo_pb2.BlobUploadHeader(sha256=model.sha256, size_bytes=model.size_bytes, offset=0)
        )
        with model.path.open("rb") as source:
            while chunk := source.read(UPLOAD_CHUNK_BYTES):
                yield cpb.UploadModelRequest(chunk=chunk)

    reply = await control.UploadModel(parts(), metadata=metadata)
    if reply.model.sha256 != model.sha256:
        raise RuntimeError(f"the coordinator stored {reply.model.sha256}, not {model.sha256}")


@dataclass(frozen=True, slots=True, kw_only=True)
class FedAvgJob:
    """The FedAvg parameters a benchmark job uses."""

    name: str
    rounds: int
    devices_per_round: int
    min_results: int
    min_devices: int
    round_timeout_s: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FedBuffJob:
    """The FedBuff parameters a benchmark job uses (the rest are the workflow's defaults)."""

    name: str
    max_model_version: int
    device_selection_size: int
    num_updates_for_model: int
    max_model_history: int = 10


async def submit_job(
    control: cgrpc.ControlServiceAsyncStub,
    metadata: Metadata,
    model_sha256: str,
    job: FedAvgJob | FedBuffJob,
) -> str:
    """Submits a FedAvg or FedBuff job and returns its id."""
    spec = cpb.JobSpec(name=job.name, initial_model=dxo_pb2.BlobRef(sha256=model_sha256))
    if isinstance(job, FedBuffJob):
        spec.fedbuff.max_model_version = job.max_model_version
        spec.fedbuff.device_selection_size = job.device_selection_size
        spec.fedbuff.num_updates_for_model = job.num_updates_for_model
        spec.fedbuff.max_model_history = job.max_model_history
        spec.fedbuff.seed = 1
    else:
        spec.fedavg.num_rounds = job.rounds
        spec.fedavg.devices_per_round = job.devices_per_round
        spec.fedavg.min_results = job.min_results
        spec.fedavg.min_devices = job.min_devices
        spec.fedavg.seed = 1
        spec.fedavg.round_timeout.FromSeconds(job.round_timeout_s)
    reply = await control.SubmitJob(
        cpb.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4())), metadata=metadata
    )
    return reply.job.job_id


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """How a job ended, and the results aggregated in each closed round (in order)."""

    state: str
    current_round: int
    round_results: tuple[int, ...]


async def job_outcome(control: cgrpc.ControlServiceAsyncStub, metadata: Metadata, job_id: str) -> JobOutcome:
    """Replays the job's events to its final state and collects each closed round's result count."""
    closed: dict[int, int] = {}
    async for event in control.WatchJob(
        cpb.WatchJobRequest(job_id=job_id, after_sequence=0), metadata=metadata
    ):
        if event.WhichOneof("event") == "round_closed":
            closed[event.round] = event.round_closed.num_results
        if event.state in _FINAL_STATES:
            break
    described = await control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=metadata)
    return JobOutcome(
        state=states_pb2.JobState.Name(described.job.state),
        current_round=described.job.current_round,
        round_results=tuple(closed[r] for r in sorted(closed)),
    )


async def abort_job(control: cgrpc.ControlServiceAsyncStub, metadata: Metadata, job_id: str) -> str:
    """Aborts a job that is still running (the benchmark's cleanup); returns "" or why it failed.

    Cleanup only: the coordinator process is stopped next anyway, so a failure is reported, not raised.
    """
    try:
        await control.AbortJob(
            cpb.AbortJobRequest(job_id=job_id, reason="benchmark over", request_id=str(uuid.uuid4())),
            metadata=metadata,
            timeout=30,
        )
    except grpc.aio.AioRpcError as exc:
        return f"AbortJob: {exc.code().name} {exc.details()}"
    return ""
