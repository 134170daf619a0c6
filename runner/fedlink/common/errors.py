"""The one error hierarchy of fedlink.

Every failure the code raises on purpose is a :class:`FedlinkError`. Each subclass names a category that
maps to exactly one gRPC status code; the mapping lives in one place on each side of the wire
(``fedlink.server.api.errors`` for the coordinator). Messages are for people: they say what was wrong
and, where it helps, what to do. An error that passes once the caller waits (a store outage, a rate
limit) says how long in ``retry_after``; on the wire it travels as a ``google.rpc.RetryInfo``.
"""

from __future__ import annotations

from datetime import timedelta


class FedlinkError(Exception):
    """Root of every error fedlink raises on purpose.

    Args:
        message: What was wrong, for a person.
        retry_after: How long the caller should wait before trying again, when waiting may help.
    """

    def __init__(self, message: str, *, retry_after: timedelta | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class InvalidArgument(FedlinkError):
    """The input is malformed: bad shape, dtype, encoding, value, or a missing field."""


class NotFound(FedlinkError):
    """An id names nothing that exists (or that the caller may see)."""


class AlreadyExists(FedlinkError):
    """Something with this identity exists already and the request would create it again."""


class FailedPrecondition(FedlinkError):
    """The request is well-formed but the system is not in a state that allows it."""


class IllegalTransition(FailedPrecondition):
    """A state machine was asked to move along an edge it does not have."""

    def __init__(self, entity: str, current: str, target: str) -> None:
        super().__init__(f"{entity} cannot go from {current} to {target}")
        self.entity = entity
        self.current = current
        self.target = target


class Conflict(FailedPrecondition):
    """A second, different write for something that may be written once (e.g. a result)."""


class ResourceExhausted(FedlinkError):
    """A size or rate limit was exceeded."""


class Unauthenticated(FedlinkError):
    """The caller presented no credential, or one that is unknown or revoked."""


class PermissionDenied(FedlinkError):
    """The caller is known but may not do this."""


class Unavailable(FedlinkError):
    """The service cannot answer now (shutting down, store unreachable); retry with backoff."""


class DataLoss(FedlinkError):
    """Stored data is corrupted or lost: e.g. a blob's bytes no longer hash to its sha256."""


class SchemaMismatch(FedlinkError):
    """The database schema is not the one this code expects (too old, or newer than the code)."""
