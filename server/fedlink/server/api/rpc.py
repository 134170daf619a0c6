"""Builds gRPC handlers for a service from its descriptor and an implementation object.

Every method goes through the same path: decode the request (bytes that are not valid protobuf get
INVALID_ARGUMENT, not the UNKNOWN/INTERNAL grpc would give), authenticate the caller, check that its
Durations are in range, run the implementation, map fedlink errors to status codes, and record
metrics. Implementations are plain async methods named like the RPCs, taking ``(request, call)`` and
returning the response (or, for server streams, an async iterator of responses; for client streams,
``request`` is an async iterator).

The caller is authenticated from its metadata *before* its request is read: every method is served to
grpc as a stream of requests, which grpc does not read until the handler asks, so a caller without a
valid credential is refused with its body unread, and one the service lets in without a credential
(``Enroll``) has its body read through :class:`~fedlink.server.api.admission.UnauthenticatedReads`
(few at once, small). See :mod:`fedlink.server.api.admission`. An implementation may have a method's
request parsed as another, wire-compatible message class by naming it in a ``request_types`` mapping
attribute (method name to class), e.g. to leave a large nested message as bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from fedlink.common.errors import FedlinkError, InvalidArgument
from fedlink.common.retry_info import STATUS_DETAILS_KEY, encode_status
from fedlink.server.api.admission import RefusedBytes, UnauthenticatedReads, read_body
from fedlink.server.api.durations import DurationPath, check_durations, duration_paths
from fedlink.server.api.errors import status_code_for, store_outage_as_unavailable
from fedlink.server.domain import Device
from fedlink.server.logs import bind_task
from fedlink.server.memory import release_soon

log = logging.getLogger(__name__)

#: Request fields that identify what a call is about; bound to its log lines.
_LOGGED_FIELDS = ("job_id", "task_id", "device_id")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: a device (by id) or an operator."""

    kind: str  # "device" | "admin" | "anonymous"
    device_id: str = ""
    #: The authenticated device, for device principals.
    device: Device | None = None


ANONYMOUS = Principal("anonymous")


@dataclass(frozen=True, slots=True)
class Call:
    """What an implementation learns about the call besides the request."""

    principal: Principal
    context: grpc.aio.ServicerContext[Any, Any]
    method: str
    #: The size of the request's body (0 for a client stream).
    request_bytes: int = 0


class Authenticator(Protocol):
    """Turns a bearer token into a principal for one service."""

    async def __call__(self, token: str | None, method: str) -> Principal:
        """Returns the caller, or raises Unauthenticated / PermissionDenied."""
        ...


class RpcObserver(Protocol):
    """Receives one observation per finished call (metrics)."""

    def observe(self, service: str, method: str, code: grpc.StatusCode, seconds: float) -> None:
        """Records a finished call."""


class _Malformed:
    """Stands in for a request whose bytes did not parse."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _deserializer(cls: type[pb_message.Message]) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return cls.FromString(data)
        except Exception as exc:  # DecodeError, and anything the C parser raises on garbage
            return _Malformed(exc)

    return parse


def _serializer(msg: pb_message.Message) -> bytes:
    return msg.SerializeToString()


def bearer_token(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The token of the ``authorization: Bearer <token>`` metadata entry, if any."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip()
    return None


class _Guard:
    """Shared pre/post processing of one method."""

    def __init__(
        self,
        service: str,
        method: str,
        authenticate: Authenticator,
        observer: RpcObserver | None,
        logged: tuple[str, ...] = (),
        durations: tuple[DurationPath, ...] = (),
        parse: Callable[[bytes], object] | None = None,
        unauthenticated: UnauthenticatedReads | None = None,
        refused: RefusedBytes | None = None,
    ) -> None:
        self.service = service
        self.method = method
        self.authenticate = authenticate
        self.observer = observer
        #: The fields of _LOGGED_FIELDS this method's request has.
        self.logged = logged
        #: Where this method's request holds Durations, each checked in range before the method runs.
        self.durations = durations
        #: Parses the request's bytes (a _Malformed for bytes that are no such message).
        self.parse: Callable[[bytes], object] = parse or bytes
        #: Reads the body of a call made without a credential (an anonymous principal).
        self.unauthenticated = unauthenticated or UnauthenticatedReads()
        #: The refused bytes each device may still make us read, if bounded (see admission.py).
        self.refused = refused

    async def receive(self, context: grpc.aio.ServicerContext[Any, Any]) -> tuple[object, Call]:
        """Authenticates the caller, then reads and parses its one request (see the module doc)."""
        principal = await self.authenticate(bearer_token(context), self.method)
        if principal.kind == ANONYMOUS.kind:
            data = await self.unauthenticated.read(context, self.method)
        else:
            if self.refused is not None and principal.device_id:
                self.refused.check(principal.device_id, self.method)  # before its body is read
            data = await read_body(context, self.method)
        request, size = self.parse(data), len(data)
        del data  # a refusal's traceback must not keep the body alive
        return request, self._admit(request, principal, context, size)

    async def begin(self, context: grpc.aio.ServicerContext[Any, Any]) -> Call:
        """Authenticates the caller of a client stream (its requests are read by the method)."""
        return self._admit(None, await self.authenticate(bearer_token(context), self.method), context)

    def _admit(
        self,
        request: object,
        principal: Principal,
        context: grpc.aio.ServicerContext[Any, Any],
        request_bytes: int = 0,
    ) -> Call:
        if isinstance(request, _Malformed):
            raise InvalidArgument(
                f"{self.method}: the request is not a valid protobuf message ({request.error})"
            )
        if self.durations and isinstance(request, pb_message.Message):
            check_durations(request, self.durations)
        # Every log line of this call carries who and what it is about (the call runs in its own task).
        fields: dict[str, object] = {}
        if request is not None:
            for name in self.logged:
                if value := getattr(request, name):
                    fields[name] = value
        if principal.device_id:
            fields["device_id"] = principal.device_id
        if fields:
            bind_task(**fields)
        return Call(principal, context, self.method, request_bytes)

    def resolve(
        self, error: Exception, context: grpc.aio.ServicerContext[Any, Any]
    ) -> tuple[grpc.StatusCode, str | None]:
        """The status that reports ``error``, and its message (None: a ``context.abort()`` sent it).

        An abort is already a status and passes through; anything else unexpected is logged and
        reported as INTERNAL, never as grpc's UNKNOWN.
        """
        if isinstance(error, FedlinkError):
            return status_code_for(error), error.message
        current = context.code()
        if isinstance(current, grpc.StatusCode) and current is not grpc.StatusCode.OK:
            return current, None  # context.abort() already set the status
        log.error("unexpected error in %s", self.method, exc_info=error)
        return grpc.StatusCode.INTERNAL, f"{self.method} failed unexpectedly; see the coordinator log"

    def fail(self, error: Exception, context: grpc.aio.ServicerContext[Any, Any]) -> grpc.StatusCode:
        """Ends the call with the status that reports ``error`` (re-raises an abort's own error).

        The status is set on the call, not sent with ``context.abort()``: abort raises an AbortError
        that grpc keeps on the call's state and whose traceback holds the handler's frame, request
        included, in a reference cycle with that state. Every refused request (a refused payload of
        hundreds of MiB too) then stayed in memory until the cyclic collector ran.
        """
        error = store_outage_as_unavailable(error)
        code, message = self.resolve(error, context)
        if message is None:
            raise error
        context.set_code(code)
        context.set_details(message)
        if code is grpc.StatusCode.UNAUTHENTICATED:
            release_soon()  # grpc buffered part of the unread body: give it back (see admission.py)
        if isinstance(error, FedlinkError) and error.retry_after is not None:
            # When to try again, as a google.rpc.RetryInfo in the standard status details.
            details = encode_status(code.value[0], message, error.retry_after)
            context.set_trailing_metadata(((STATUS_DETAILS_KEY, details),))
        return code

    def done(self, code: grpc.StatusCode, started: float, call: Call | None) -> None:
        if self.refused is not None and call is not None and call.principal.device_id:
            self.refused.charge(call.principal.device_id, code, call.request_bytes)
        if self.observer is not None:
            self.observer.observe(self.service, self.method, code, time.perf_counter() - started)


def _unary(guard: _Guard, impl: Callable[..., Awaitable[Any]], *, streamed: bool) -> Callable[..., Any]:
    async def handle(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        started, code = time.perf_counter(), grpc.StatusCode.INTERNAL
        call: Call | None = None
        try:
            request: object
            if streamed:
                call = await guard.begin(context)
                request = _checked_stream(requests, guard.method)
            else:
                request, call = await guard.receive(context)
            response = await impl(request, call)
            code = grpc.StatusCode.OK
            return response
        except Exception as exc:
            code = guard.fail(exc, context)
            return None
        finally:
            guard.done(code, started, call)

    return handle


def _server_stream(guard: _Guard, impl: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
    async def handle(requests: object, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        started, code = time.perf_counter(), grpc.StatusCode.INTERNAL
        call: Call | None = None
        try:
            request, call = await guard.receive(context)
            async for item in impl(request, call):
                yield item
            code = grpc.StatusCode.OK
        except Exception as exc:
            code = guard.fail(exc, context)
        finally:
            guard.done(code, started, call)

    return handle


async def _checked_stream(requests: AsyncIterator[object], method: str) -> AsyncIterator[object]:
    async for item in requests:
        if isinstance(item, _Malformed):
            raise InvalidArgument(f"{method}: a stream message is not valid protobuf ({item.error})")
        yield item


def method_handlers(
    service: ServiceDescriptor,
    implementation: object,
    authenticate: Authenticator,
    observer: RpcObserver | None = None,
    unauthenticated: UnauthenticatedReads | None = None,
    refused: RefusedBytes | None = None,
) -> grpc.GenericRpcHandler:
    """Returns a generic handler serving every RPC of ``service`` from ``implementation``.

    Args:
        service: The service's descriptor.
        implementation: Has an async method per RPC (and optionally ``request_types``).
        authenticate: Turns the caller's bearer token into a principal, before its request is read.
        observer: Told about every finished call.
        unauthenticated: The gate through which the requests of callers that the authenticator lets
            in without a credential are read (default: one of this service's own).
        refused: Bounds the refused bytes each device may make the service read (default: no bound).

    Raises:
        TypeError: if ``implementation`` lacks a method for one of the service's RPCs.
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    unauthenticated = unauthenticated or UnauthenticatedReads()
    declared = getattr(implementation, "request_types", None)
    request_types: Mapping[str, type[pb_message.Message]] = declared if isinstance(declared, Mapping) else {}
    for method in service.methods:
        impl = getattr(implementation, method.name, None)
        if impl is None:
            raise TypeError(
                f"{type(implementation).__name__} does not implement {service.name}.{method.name}"
            )
        handlers[method.name] = _handler_for(
            service,
            method,
            impl,
            authenticate,
            observer,
            unauthenticated,
            request_types.get(method.name),
            refused,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _handler_for(
    service: ServiceDescriptor,
    method: MethodDescriptor,
    impl: Callable[..., Any],
    authenticate: Authenticator,
    observer: RpcObserver | None,
    unauthenticated: UnauthenticatedReads,
    request_cls: type[pb_message.Message] | None = None,
    refused: RefusedBytes | None = None,
) -> grpc.RpcMethodHandler[Any, Any]:
    logged = tuple(name for name in _LOGGED_FIELDS if name in method.input_type.fields_by_name)
    durations = duration_paths(method.input_type)
    parse = _deserializer(request_cls or message_factory.GetMessageClass(method.input_type))
    guard = _Guard(
        service.name, method.name, authenticate, observer, logged, durations, parse, unauthenticated, refused
    )
    if method.client_streaming and not method.server_streaming:
        return grpc.stream_unary_rpc_method_handler(
            _unary(guard, impl, streamed=True), request_deserializer=parse, response_serializer=_serializer
        )
    if method.client_streaming and method.server_streaming:
        raise TypeError(f"bidirectional streams are not supported ({method.full_name})")
    # A unary request is served as a stream of requests: read (as bytes) only once the caller is
    # authenticated, then parsed by the guard.
    if method.server_streaming:
        return grpc.stream_stream_rpc_method_handler(
            _server_stream(guard, impl), response_serializer=_serializer
        )
    return grpc.stream_unary_rpc_method_handler(
        _unary(guard, impl, streamed=False), response_serializer=_serializer
    )


__all__ = [
    "ANONYMOUS",
    "Authenticator",
    "Call",
    "Principal",
    "RpcObserver",
    "method_handlers",
]
