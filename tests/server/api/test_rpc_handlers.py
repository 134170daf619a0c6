"""The handler builder: malformed bytes, error mapping, auth and metrics, over a real grpc.aio server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from fedlink.common.errors import Conflict, NotFound, PermissionDenied, Unauthenticated
from fedlink.server.api.rpc import Call, Principal, method_handlers
from fedlink.server.logs import bound_fields
from fedlink.v1 import runner_service_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["RunnerService"]


class _Impl:
    """Answers per job_id so each test can pick the behaviour it needs."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.log_fields: list[dict[str, object]] = []

    async def GetJob(self, request: pb.GetJobRequest, call: Call) -> pb.GetJobResponse:
        self.calls.append(call)
        self.log_fields.append(dict(bound_fields()))
        if request.job_name == "missing":
            raise NotFound("job 'missing' does not exist")
        if request.job_name == "conflict":
            raise Conflict("a different result was reported already")
        if request.job_name == "boom":
            raise ZeroDivisionError("bug")
        return pb.GetJobResponse(status=pb.RUNNER_STATUS_OK, job_name=call.principal.device_id)

    async def ReportResult(self, request: pb.ReportResultRequest, call: Call) -> pb.ReportResultResponse:
        self.log_fields.append(dict(bound_fields()))
        return pb.ReportResultResponse(status=pb.RUNNER_STATUS_OK)

    async def UploadBlob(
        self, requests: AsyncIterator[pb.UploadBlobRequest], call: Call
    ) -> pb.UploadBlobResponse:
        total = 0
        async for r in requests:
            total += len(r.chunk)
        response = pb.UploadBlobResponse()
        response.blob.size_bytes = total
        return response

    async def DownloadBlob(self, request: pb.DownloadBlobRequest, call: Call) -> AsyncIterator[Any]:
        for i in range(3):
            yield pb.DownloadBlobResponse(offset=i)
        raise NotFound("gone midway")

    def __getattr__(self, name: str) -> Any:
        async def unimplemented(request: Any, call: Call) -> Any:
            raise NotFound(name)

        return unimplemented


class _Observer:
    def __init__(self) -> None:
        self.seen: list[tuple[str, grpc.StatusCode]] = []

    def observe(self, service: str, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.seen.append((method, code))


async def _auth(token: str | None, method: str) -> Principal:
    if token is None:
        raise Unauthenticated("no credential")
    if token == "device-b":
        raise PermissionDenied("not yours")
    return Principal("device", device_id=token)


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, _Impl, _Observer]]:
    impl, observer = _Impl(), _Observer()
    srv = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    srv.add_generic_rpc_handlers((method_handlers(SERVICE, impl, _auth, observer),))
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    yield f"127.0.0.1:{port}", impl, observer
    await srv.stop(None)


async def _observed(observer: _Observer, count: int) -> list[tuple[str, grpc.StatusCode]]:
    """The observations once ``count`` calls finished (the server records after the reply is sent)."""
    for _ in range(200):
        if len(observer.seen) >= count:
            break
        await asyncio.sleep(0.005)
    return observer.seen


def _meta(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


async def test_bytes_that_are_not_protobuf_get_invalid_argument(server: tuple[str, _Impl, _Observer]) -> None:
    address, impl, observer = server
    async with grpc.aio.insecure_channel(address) as channel:
        raw: Any = channel.unary_unary("/fedlink.v1.RunnerService/GetJob")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(b"\xff\xff\xff\xff", metadata=_meta("dev-1"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid protobuf" in (info.value.details() or "")
    assert impl.calls == []
    assert await _observed(observer, 1) == [("GetJob", grpc.StatusCode.INVALID_ARGUMENT)]


@pytest.mark.parametrize(
    ("job_name", "token", "code"),
    [
        ("missing", "dev-1", grpc.StatusCode.NOT_FOUND),
        ("conflict", "dev-1", grpc.StatusCode.FAILED_PRECONDITION),
        ("boom", "dev-1", grpc.StatusCode.INTERNAL),
        ("ok", "device-b", grpc.StatusCode.PERMISSION_DENIED),
    ],
)
async def test_errors_map_to_precise_codes(
    server: tuple[str, _Impl, _Observer], job_name: str, token: str, code: grpc.StatusCode
) -> None:
    address, _, observer = server
    async with grpc.aio.insecure_channel(address) as channel:
        stub = channel.unary_unary(
            "/fedlink.v1.RunnerService/GetJob",
            request_serializer=pb.GetJobRequest.SerializeToString,
            response_deserializer=pb.GetJobResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub(pb.GetJobRequest(job_name=job_name), metadata=_meta(token))
    assert info.value.code() == code
    assert await _observed(observer, 1) == [("GetJob", code)]


async def test_identity_comes_from_the_credential(server: tuple[str, _Impl, _Observer]) -> None:
    address, impl, observer = server
    async with grpc.aio.insecure_channel(address) as channel:
        stub = channel.unary_unary(
            "/fedlink.v1.RunnerService/GetJob",
            request_serializer=pb.GetJobRequest.SerializeToString,
            response_deserializer=pb.GetJobResponse.FromString,
        )
        reply = await stub(pb.GetJobRequest(job_name="ok"), metadata=_meta("dev-7"))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub(pb.GetJobRequest(job_name="ok"))
    assert reply.job_name == "dev-7"
    assert impl.log_fields[0]["device_id"] == "dev-7"  # log lines of the call carry the caller
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert await _observed(observer, 2) == [
        ("GetJob", grpc.StatusCode.OK),
        ("GetJob", grpc.StatusCode.UNAUTHENTICATED),
    ]


async def test_streams_are_guarded_too(server: tuple[str, _Impl, _Observer]) -> None:
    address, _, observer = server
    async with grpc.aio.insecure_channel(address) as channel:
        upload: Any = channel.stream_unary(
            "/fedlink.v1.RunnerService/UploadBlob", response_deserializer=pb.UploadBlobResponse.FromString
        )
        chunks = [pb.UploadBlobRequest(chunk=b"abc").SerializeToString(), b"\xff\xff\xff"]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await upload(iter(chunks), metadata=_meta("dev-1"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        download = channel.unary_stream(
            "/fedlink.v1.RunnerService/DownloadBlob",
            request_serializer=pb.DownloadBlobRequest.SerializeToString,
            response_deserializer=pb.DownloadBlobResponse.FromString,
        )
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for item in download(pb.DownloadBlobRequest(sha256="x"), metadata=_meta("dev-1")):
                got.append(item.offset)
        assert got == [0, 1, 2]
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert await _observed(observer, 2) == [
        ("UploadBlob", grpc.StatusCode.INVALID_ARGUMENT),
        ("DownloadBlob", grpc.StatusCode.NOT_FOUND),
    ]


def test_a_missing_implementation_is_refused_at_startup() -> None:
    class Partial:
        async def GetJob(self, request: Any, call: Call) -> Any:
            return None

    with pytest.raises(TypeError, match="does not implement RunnerService"):
        method_handlers(SERVICE, Partial(), _auth)


async def test_log_lines_carry_what_the_call_is_about(server: tuple[str, _Impl, _Observer]) -> None:
    address, impl, _ = server
    async with grpc.aio.insecure_channel(address) as channel:
        stub = channel.unary_unary(
            "/fedlink.v1.RunnerService/ReportResult",
            request_serializer=pb.ReportResultRequest.SerializeToString,
            response_deserializer=pb.ReportResultResponse.FromString,
        )
        await stub(pb.ReportResultRequest(job_id="job-1", task_id="task-1"), metadata=_meta("dev-7"))
        await stub(pb.ReportResultRequest(job_id="job-2"), metadata=_meta("dev-8"))
    assert impl.log_fields == [
        {"job_id": "job-1", "task_id": "task-1", "device_id": "dev-7"},
        {"job_id": "job-2", "device_id": "dev-8"},  # an empty field is left out
    ]
