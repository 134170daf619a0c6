"""Bodies are read only once the caller may send them: refused callers unread, anonymous ones few and
small, a device that keeps sending what is refused stopped before its next body; and ReportResult's
inline DXO kept as the bytes that were sent."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import grpc
import numpy as np
import pytest

from fedlink.common.errors import ResourceExhausted, Unauthenticated
from fedlink.server.api.admission import RefusedBytes, UnauthenticatedReads
from fedlink.server.api.report_view import REPORT_RESULT_VIEW, read_report
from fedlink.server.api.rpc import ANONYMOUS, Call, Principal, method_handlers
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["RunnerService"]
MiB = 1024 * 1024


class _Impl:
    def __init__(self) -> None:
        self.requests: list[tuple[str, int]] = []

    async def Enroll(self, request: pb.EnrollRequest, call: Call) -> pb.EnrollResponse:
        self.requests.append(("Enroll", call.request_bytes))
        return pb.EnrollResponse(device_id="dev-new")

    async def GetJob(self, request: pb.GetJobRequest, call: Call) -> pb.GetJobResponse:
        self.requests.append(("GetJob", call.request_bytes))
        if request.job_name == "refuse me":
            from fedlink.common.errors import InvalidArgument

            raise InvalidArgument("refused for its content")
        return pb.GetJobResponse(status=pb.RUNNER_STATUS_NO_JOB)

    def __getattr__(self, name: str) -> Any:
        async def unimplemented(request: Any, call: Call) -> Any:
            raise NotImplementedError(name)

        return unimplemented


async def _auth(token: str | None, method: str) -> Principal:
    if method == "Enroll":
        return ANONYMOUS
    if token != "dev-1":
        raise Unauthenticated("this call needs a device credential")
    return Principal("device", device_id=token)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def server() -> AsyncIterator[tuple[grpc.aio.Channel, _Impl, RefusedBytes, _Clock]]:
    impl, clock = _Impl(), _Clock()
    refused = RefusedBytes(burst_bytes=5 * MiB // 2, refill_bytes_per_s=MiB, clock=clock)
    reads = UnauthenticatedReads(max_bytes=64 * 1024)
    srv = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 32 * MiB)])
    srv.add_generic_rpc_handlers((method_handlers(SERVICE, impl, _auth, None, reads, refused),))
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    options = [("grpc.max_send_message_length", 32 * MiB)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        yield channel, impl, refused, clock
    await srv.stop(None)


def _padded_get_job(job_name: str, size: int) -> bytes:
    # Unknown field 15 carries the padding: a valid GetJobRequest of about ``size`` bytes.
    pad = b"x" * size
    return pb.GetJobRequest(job_name=job_name).SerializeToString() + b"\x7a" + _varint(len(pad)) + pad


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


async def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


async def test_a_caller_without_a_valid_credential_is_refused_unread(
    server: tuple[grpc.aio.Channel, _Impl, RefusedBytes, _Clock],
) -> None:
    channel, impl, _, _ = server
    get_job: Any = channel.unary_unary("/fedlink.v1.RunnerService/GetJob")
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        code, _ = await _code(get_job(_padded_get_job("", 16 * MiB), metadata=metadata))
        assert code is grpc.StatusCode.UNAUTHENTICATED
    assert impl.requests == []
    # The same body with a credential is read, whole.
    code, _ = await _code(
        get_job(_padded_get_job("", 16 * MiB), metadata=(("authorization", "Bearer dev-1"),))
    )
    assert code is grpc.StatusCode.OK
    assert impl.requests == [("GetJob", len(_padded_get_job("", 16 * MiB)))]


async def test_an_anonymous_request_above_the_limit_is_refused_unparsed(
    server: tuple[grpc.aio.Channel, _Impl, RefusedBytes, _Clock],
) -> None:
    channel, impl, _, _ = server
    enroll: Any = channel.unary_unary("/fedlink.v1.RunnerService/Enroll")
    small = pb.EnrollRequest(request_id="r" * 36, device_info={"platform": "test"}).SerializeToString()
    assert (await _code(enroll(small)))[0] is grpc.StatusCode.OK
    big = pb.EnrollRequest(request_id="r" * 36, device_info={"pad": "x" * (5 * MiB)}).SerializeToString()
    code, details = await _code(enroll(big))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"{len(big)} bytes" in details and "at most 65536" in details
    assert [name for name, _ in impl.requests] == ["Enroll"]


async def test_a_device_that_keeps_sending_what_is_refused_waits_before_it_is_read(
    server: tuple[grpc.aio.Channel, _Impl, RefusedBytes, _Clock],
) -> None:
    channel, impl, _, clock = server
    get_job: Any = channel.unary_unary("/fedlink.v1.RunnerService/GetJob")
    me = (("authorization", "Bearer dev-1"),)
    refused = _padded_get_job("refuse me", MiB)
    for _ in range(3):  # 3 MiB refused: half a MiB past the 2.5 MiB burst
        assert (await _code(get_job(refused, metadata=me)))[0] is grpc.StatusCode.INVALID_ARGUMENT
    read = len(impl.requests)
    code, details = await _code(get_job(_padded_get_job("", 10), metadata=me))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "read again in" in details
    assert len(impl.requests) == read  # not read
    clock.now += 1.5  # refilled past zero
    assert (await _code(get_job(_padded_get_job("", 10), metadata=me)))[0] is grpc.StatusCode.OK


def test_refused_bytes_count_only_refusals_for_content() -> None:
    clock = _Clock()
    budget = RefusedBytes(burst_bytes=100, refill_bytes_per_s=10, clock=clock, max_devices=2)
    budget.charge("a", grpc.StatusCode.OK, 1_000)
    budget.charge("a", grpc.StatusCode.UNAVAILABLE, 1_000)
    budget.check("a", "M")
    budget.charge("a", grpc.StatusCode.FAILED_PRECONDITION, 150)
    with pytest.raises(ResourceExhausted) as info:
        budget.check("a", "M")
    assert info.value.retry_after == timedelta(seconds=5)
    clock.now = 5.0
    budget.check("a", "M")
    budget.charge("b", grpc.StatusCode.INVALID_ARGUMENT, 1)
    budget.charge("c", grpc.StatusCode.INVALID_ARGUMENT, 1)  # forgets "a", the least recently charged
    budget.check("a", "M")
    assert len(budget._buckets) == 2


def test_the_report_view_keeps_the_inline_dxo_as_sent() -> None:
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    dxo.data["w"].CopyFrom(
        dxo_pb2.Tensor(
            dtype="float32", shape=[3], dense=dxo_pb2.DenseEncoding(data=np.ones(3, "<f4").tobytes())
        )
    )
    request = pb.ReportResultRequest(
        job_id="j",
        task_id="t",
        cookie=b"c",
        status=states_pb2.RESULT_STATUS_SUCCEEDED,
        error_message="e",
        request_id="r",
    )
    request.result.dxo.CopyFrom(dxo)
    fields = read_report(REPORT_RESULT_VIEW.FromString(request.SerializeToString()))
    assert fields.inline == dxo.SerializeToString()
    assert (fields.job_id, fields.task_id, fields.cookie, fields.error_message, fields.request_id) == (
        "j",
        "t",
        b"c",
        "e",
        "r",
    )
    assert fields.status == states_pb2.RESULT_STATUS_SUCCEEDED and fields.blob_sha256 is None
    assert read_report(request) == fields  # the generated class reads the same
    by_blob = pb.ReportResultRequest(job_id="j")
    by_blob.result.blob.sha256 = "ab" * 32
    view = read_report(REPORT_RESULT_VIEW.FromString(by_blob.SerializeToString()))
    assert view.blob_sha256 == "ab" * 32 and view.inline is None
    # Every field of the request is in the view.
    assert [f.name for f in REPORT_RESULT_VIEW.DESCRIPTOR.fields] == [
        f.name for f in pb.ReportResultRequest.DESCRIPTOR.fields
    ]
