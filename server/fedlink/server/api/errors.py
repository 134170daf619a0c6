"""The one mapping from fedlink errors to gRPC status codes."""

from __future__ import annotations

import grpc

from fedlink.common import errors
from fedlink.server.store.outages import StoreRetryPolicy, StoreUnavailable, is_connection_loss

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
    (errors.DataLoss, grpc.StatusCode.DATA_LOSS),
)


def status_code_for(error: errors.FedlinkError) -> grpc.StatusCode:
    """The gRPC status code that reports ``error`` (subclasses map like their nearest base)."""
    for cls, code in _CODES:
        if isinstance(error, cls):
            return code
    return grpc.StatusCode.INTERNAL


def store_outage_as_unavailable(error: Exception) -> Exception:
    """A database connection error that escaped the store's own retries, as the UNAVAILABLE (with a
    ``retry_after``) it means: the coordinator's store failed, not the caller. Other errors as they are."""
    if isinstance(error, errors.FedlinkError) or not is_connection_loss(error):
        return error
    retry_after = StoreRetryPolicy().retry_after
    unavailable = StoreUnavailable(
        f"the coordinator's database is unavailable ({type(error).__name__}); "
        f"retry in {retry_after.total_seconds():g}s",
        retry_after=retry_after,
    )
    unavailable.__cause__ = error
    return unavailable
