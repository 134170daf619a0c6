"""The one mapping from fedlink errors to gRPC status codes."""

from __future__ import annotations

import grpc

from fedlink.common import errors

_CODES: tuple[tuple[type[errors.FedlinkError], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.SchemaMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
)


def status_code_for(error: errors.FedlinkError) -> grpc.StatusCode:
    """The gRPC status code that reports ``error`` (subclasses map like their nearest base)."""
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL
