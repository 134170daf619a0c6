"""How long to wait before retrying, carried with an error status: gRPC's rich error model.

A fault that passes once the caller waits (the coordinator's store is away, a rate limit) is answered
with its status code (UNAVAILABLE, RESOURCE_EXHAUSTED) and a ``google.rpc.Status`` in the
``grpc-status-details-bin`` trailer whose details hold a ``google.rpc.RetryInfo``: its ``retry_delay``
is a ``google.protobuf.Duration``, as every ``retry_after`` of the device protocol is. gRPC libraries of
other languages read it as it is (Go's ``status.FromError(err).Details()``, Java's
``StatusProto.fromThrowable``). The two messages are declared here, in a private descriptor pool, so
that neither side needs googleapis-common-protos (and a copy of them installed is not disturbed).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, duration_pb2, message_factory

#: The trailer that holds a serialized ``google.rpc.Status`` (gRPC's convention).
STATUS_DETAILS_KEY = "grpc-status-details-bin"
_RETRY_INFO_TYPE = "type.googleapis.com/google.rpc.RetryInfo"


def _message_classes() -> tuple[Any, Any]:
    """``google.rpc.Status`` and ``google.rpc.RetryInfo``, as googleapis/google/rpc declares them."""
    pool = descriptor_pool.DescriptorPool()
    for known in (any_pb2, duration_pb2):
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(known.DESCRIPTOR.serialized_pb))
    field = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(
        name="fedlink/common/google_rpc_retry_info.proto",
        package="google.rpc",
        syntax="proto3",
        dependency=["google/protobuf/any.proto", "google/protobuf/duration.proto"],
    )
    status = proto.message_type.add(name="Status")
    status.field.add(name="code", number=1, type=field.TYPE_INT32, label=field.LABEL_OPTIONAL)
    status.field.add(name="message", number=2, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    status.field.add(
        name="details",
        number=3,
        type=field.TYPE_MESSAGE,
        label=field.LABEL_REPEATED,
        type_name=".google.protobuf.Any",
    )
    retry_info = proto.message_type.add(name="RetryInfo")
    retry_info.field.add(
        name="retry_delay",
        number=1,
        type=field.TYPE_MESSAGE,
        label=field.LABEL_OPTIONAL,
        type_name=".google.protobuf.Duration",
    )
    pool.Add(proto)
    described = pool.FindFileByName(proto.name)
    return (
        message_factory.GetMessageClass(described.message_types_by_name["Status"]),
        message_factory.GetMessageClass(described.message_types_by_name["RetryInfo"]),
    )


_Status, _RetryInfo = _message_classes()


def encode_status(code: int, message: str, retry_after: timedelta) -> bytes:
    """A serialized ``google.rpc.Status`` with one ``RetryInfo`` detail.

    Args:
        code: The numeric gRPC status code (as the call's own status says it).
        message: The status message (as the call's own details say it).
        retry_after: The wait before retrying (negative waits are sent as zero).
    """
    # The private pool's own Duration and Any: set in place (messages of the default pool do not mix).
    info = _RetryInfo()
    info.retry_delay.FromTimedelta(max(retry_after, timedelta(0)))
    status = _Status(code=code, message=message)
    status.details.add(type_url=_RETRY_INFO_TYPE, value=info.SerializeToString())
    data: bytes = status.SerializeToString()
    return data


def decode_retry_after(status_details: bytes) -> timedelta | None:
    """The ``RetryInfo.retry_delay`` of a serialized ``google.rpc.Status``; None if it has none or the
    bytes do not parse."""
    try:
        status = _Status.FromString(status_details)
        for detail in status.details:
            if detail.type_url == _RETRY_INFO_TYPE:
                delay: timedelta = _RetryInfo.FromString(detail.value).retry_delay.ToTimedelta()
                return delay
    except Exception:  # a peer's garbage is no reason to fail the retry that reads it
        return None
    return None


def retry_after_of(trailing_metadata: Iterable[tuple[str, str | bytes]] | None) -> timedelta | None:
    """The wait a failed call's trailing metadata asks for (its ``RetryInfo``), if any."""
    for key, value in trailing_metadata or ():
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            return decode_retry_after(value)
    return None
