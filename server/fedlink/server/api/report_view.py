"""``ReportResultRequest`` read with its inline DXO left as bytes, so that no DXO is parsed on the event loop.

Parsing a whole ``ReportResultRequest`` parses the result DXO with it: for a 3.2 MB report of 100,000
one-element tensors that is one C call of 40 to 80 ms holding the GIL, before any check can refuse it,
and re-serializing it (deterministically, to identify its content) another 80 to 100 ms. Here the
request is parsed as a message of the same fields whose ``result.dxo`` is declared ``bytes``: the same
wire format (a message field and a bytes field are both length-delimited), so the DXO's bytes come out
as sent, for the device protocol to parse and check off the event loop
(:mod:`fedlink.server.protocol.decoding`).

The view's descriptors are copied from the generated ones at import, so a field added to the request
appears here too. One difference from the protobuf runtime remains: a ``dxo`` field sent twice in one
message is taken whole from its last occurrence, where the runtime would merge the two (no protobuf
library writes a message field twice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory
from google.protobuf.descriptor import FileDescriptor

from fedlink.v1 import dxo_pb2, runner_service_pb2

__all__ = ["REPORT_RESULT_VIEW", "ReportFields", "read_report"]

_PACKAGE: Final = "fedlink.server.view"


def _build() -> type[message.Message]:
    pool = descriptor_pool.DescriptorPool()
    for file in _dependencies(runner_service_pb2.DESCRIPTOR):
        pool.AddSerializedFile(file.serialized_pb)
    view = descriptor_pb2.FileDescriptorProto(
        name="fedlink/server/view/report_view.proto",
        package=_PACKAGE,
        syntax="proto3",
        dependency=[d.name for d in runner_service_pb2.DESCRIPTOR.dependencies],
    )
    payload = view.message_type.add()
    dxo_pb2.Payload.DESCRIPTOR.CopyToProto(payload)
    for field in payload.field:
        if field.name == "dxo":
            field.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
            field.ClearField("type_name")
    request = view.message_type.add()
    runner_service_pb2.ReportResultRequest.DESCRIPTOR.CopyToProto(request)
    for field in request.field:
        if field.name == "result":
            field.type_name = f".{_PACKAGE}.{payload.name}"
    pool.Add(view)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{request.name}"))


def _dependencies(file: FileDescriptor) -> list[FileDescriptor]:
    """``file``'s imports, transitively, each before what imports it."""
    ordered: list[FileDescriptor] = []

    def visit(f: FileDescriptor) -> None:
        for dependency in f.dependencies:
            visit(dependency)
        if f not in ordered:
            ordered.append(f)

    for dependency in file.dependencies:
        visit(dependency)
    return ordered


#: The request class RunnerService.ReportResult is parsed as (see the module's docstring).
REPORT_RESULT_VIEW: Final[type[message.Message]] = _build()


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportFields:
    """A ReportResult request's fields, its inline DXO as the bytes that were sent."""

    job_id: str
    task_id: str
    cookie: bytes
    #: The ``fedlink.v1.ResultStatus`` number.
    status: int
    #: The serialized DXO, when the result came inline.
    inline: bytes | None
    #: The sha256 of the uploaded blob holding the result, when it came as a blob.
    blob_sha256: str | None
    error_message: str
    request_id: str


def read_report(request: message.Message) -> ReportFields:
    """The fields of a request parsed as :data:`REPORT_RESULT_VIEW` (or as ``ReportResultRequest``)."""
    r: runner_service_pb2.ReportResultRequest = request  # type: ignore[assignment]
    where = r.result.WhichOneof("location")
    inline: bytes | None = None
    if where == "dxo":
        dxo = r.result.dxo
        # A request parsed as the generated class (in-process callers, tests) holds a message.
        inline = dxo if isinstance(dxo, bytes) else dxo.SerializeToString(deterministic=True)
    return ReportFields(
        job_id=r.job_id,
        task_id=r.task_id,
        cookie=r.cookie,
        status=int(r.status),
        inline=inline,
        blob_sha256=r.result.blob.sha256 if where == "blob" else None,
        error_message=r.error_message,
        request_id=r.request_id,
    )
