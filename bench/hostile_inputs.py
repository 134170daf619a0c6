"""What a hostile device sends, as raw gRPC, for the hostile-fleet benchmark and the battery test.

Every payload is built once and sent as bytes (a raw ``unary_unary`` with no serializer), so that a
sender can go as fast as the coordinator answers: building a 100,000-tensor message costs the
sender a second, sending its bytes again costs nothing. :class:`HealthProbe` runs
``bench.health_prober`` beside the traffic and returns what each probe took.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import numpy as np

from bench.child_processes import REPO
from bench.orphans import tied
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

MiB = 1024 * 1024
#: The issue's many-tensor report: 100,000 one-element tensors, 3.2 MB.
MANY_TENSORS = 100_000
#: What the issue's 47-byte report declared: a sparse bfloat16 tensor of 2**27 elements (256 MiB as
#: float32 once decoded).
HUGE_ELEMENTS = 2**27
#: JSON nested this deep raised RecursionError (INTERNAL) in meta and job_data.
DEEP_JSON = 10_000

RUNNER = "/fedlink.v1.RunnerService"
CONTROL = "/fedlink.v1.ControlService"


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def many_tensors(count: int = MANY_TENSORS) -> bytes:
    """A WEIGHT_DIFF of ``count`` one-element float32 tensors (none of them a model's variable)."""
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    one = np.float32(1).astype("<f4").tobytes()
    for i in range(count):
        tensor = dxo.data[f"v{i}"]
        tensor.dtype = "float32"
        tensor.shape.append(1)
        tensor.dense.data = one
    dxo.meta["num_examples"].int_value = 1
    return dxo.SerializeToString()


def huge_sparse(name: str = "w", elements: int = HUGE_ELEMENTS) -> bytes:
    """A WEIGHT_DIFF whose one sparse bfloat16 tensor declares ``elements`` and carries no value."""
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    dxo.data[name].CopyFrom(
        dxo_pb2.Tensor(dtype="bfloat16", shape=[elements], sparse=dxo_pb2.SparseEncoding())
    )
    dxo.meta["num_examples"].int_value = 1
    return dxo.SerializeToString()


def deep_meta(shape: tuple[int, ...], name: str = "w", depth: int = DEEP_JSON) -> bytes:
    """A well-formed update of the model (all zeros, as an empty sparse tensor) whose meta holds JSON
    nested ``depth`` deep."""
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    dxo.data[name].CopyFrom(
        dxo_pb2.Tensor(dtype="float32", shape=list(shape), sparse=dxo_pb2.SparseEncoding())
    )
    dxo.meta["num_examples"].int_value = 1
    dxo.meta["config"].json_value = "[" * depth + "]" * depth
    return dxo.SerializeToString()


def dense_nan(elements: int, name: str = "w") -> bytes:
    """An update of the model's full size whose last value is NaN: decoded and checked whole, refused."""
    values = np.zeros(elements, "<f4")
    values[-1] = np.nan
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    dxo.data[name].CopyFrom(
        dxo_pb2.Tensor(dtype="float32", shape=[elements], dense=dxo_pb2.DenseEncoding(data=values.tobytes()))
    )
    dxo.meta["num_examples"].int_value = 1
    return dxo.SerializeToString()


def report_bytes(job_id: str, task_id: str, cookie: bytes, dxo: bytes, request_id: str = "") -> bytes:
    """A serialized ReportResultRequest (SUCCEEDED) carrying the serialized ``dxo`` inline, built
    without parsing it (a message's bytes are its fields' bytes, in any order)."""
    head = rpb.ReportResultRequest(
        job_id=job_id,
        task_id=task_id,
        cookie=cookie,
        status=states_pb2.RESULT_STATUS_SUCCEEDED,
        request_id=request_id or str(uuid.uuid4()),
    ).SerializeToString()
    return head + _field(5, _field(1, dxo))  # ReportResultRequest.result = Payload{dxo}


def raw_call(channel: grpc.aio.Channel, path: str) -> Callable[..., Any]:
    """A unary call that sends bytes as they are and returns the reply's bytes."""
    return channel.unary_unary(path)


def padded_enroll(size_bytes: int) -> bytes:
    """An EnrollRequest of about ``size_bytes``, nearly all of it one device_info value."""
    request = rpb.EnrollRequest(protocol_version="1.0", request_id=str(uuid.uuid4()))
    request.device_info["padding"] = "x" * max(0, size_bytes - 64)
    return request.SerializeToString()


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one raw call ended: its status code name and details (OK: the reply's bytes are dropped)."""

    code: str
    details: str


async def outcome_of(call: Any) -> Outcome:
    """Awaits a raw call; its outcome, never raising for a status."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return Outcome(error.code().name, error.details() or "")
    return Outcome("OK", "")


class HealthProbe:
    """``python -m bench.health_prober`` against ``address`` while the context is open.

    ``result`` holds the prober's summary once the context has exited.
    """

    def __init__(
        self, address: str, workdir: Path, *, interval_ms: float = 20.0, name: str = "prober"
    ) -> None:
        self._address = address
        self._interval_ms = interval_ms
        self._stderr = workdir / f"{name}.stderr.log"
        self._process: asyncio.subprocess.Process | None = None
        self.result: dict[str, Any] = {}

    async def __aenter__(self) -> HealthProbe:
        with self._stderr.open("wb") as stderr:
            self._process = await asyncio.create_subprocess_exec(
                *tied([sys.executable]),
                "-m",
                "bench.health_prober",
                "--address",
                self._address,
                "--interval-ms",
                str(self._interval_ms),
                cwd=REPO,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
            )
        await self._event("ready", 60)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        process = self._process
        assert process is not None and process.stdin is not None
        process.stdin.close()
        try:
            self.result = await self._event("result", 60)
        finally:
            if process.returncode is None:
                process.kill()
            await process.wait()

    async def _event(self, name: str, timeout_s: float) -> dict[str, Any]:
        assert self._process is not None and self._process.stdout is not None
        line = await asyncio.wait_for(self._process.stdout.readline(), timeout_s)
        if not line:
            await self._process.wait()
            tail = self._stderr.read_text(errors="replace")[-2000:]
            raise RuntimeError(
                f"the health prober exited ({self._process.returncode}) before {name!r}:\n{tail}"
            )
        event: dict[str, Any] = json.loads(line)
        if event.get("event") != name:
            raise RuntimeError(f"expected {name!r} from the health prober, got {event!r}")
        return event
