"""Builds gRPC handlers for a service from its descriptor and an implementation object.

Every method goes through the same path: decode the request (bytes that are not valid protobuf get
INVALID_ARGUMENT, not the UNKNOWN/INTERNAL grpc would give), authenticate the caller, check that its
Durations are in range, run the implementation, map fedlink errors to status codes, and record
metrics. Implementations are plain async methods named like the RPCs, taking ``(request, call)`` and
returning the response (or, for server streams, an async iterator of responses; for client streams,
``request`` is an async iterator).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from fedlink.common.errors import FedlinkError, InvalidArgument
from fedlink.server.api.durations import DurationPath, check_durations, duration_paths
from fedlink.server.api.errors import status_code_for
from fedlink.server.domain import Device
from fedlink.server.logs import bind_task

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
    ) -> None:
        self.service = service
        self.method = method
        self.authenticate = authenticate
        self.observer = observer
        #: The fields of _LOGGED_FIELDS this method's request has.
        self.logged = logged
        #: Where this method's request holds Durations, each checked in range before the method runs.
        self.durations = durations

    async def begin(self, request: object, context: grpc.aio.ServicerContext[Any, Any]) -> Call:
        if isinstance(request, _Malformed):
            raise InvalidArgument(
                f"{self.method}: the request is not a valid protobuf message ({request.error})"
            )
        principal = await self.authenticate(bearer_token(context), self.method)
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
        return Call(principal, context, self.method)

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
        code, message = self.resolve(error, context)
        if message is None:
            raise error
        context.set_code(code)
        context.set_details(message)
        return code

    def done(self, code: grpc.StatusCode, started: float) -> None:
        if self.observer is not None:
            self.observer.observe(self.service, self.method, code, time.perf_counter() - started)


def _unary(guard: _Guard, impl: Callable[..., Awaitable[Any]], *, streamed: bool) -> Callable[..., Any]:
    async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        started, code = time.perf_counter(), grpc.StatusCode.INTERNAL
        try:
            call = await guard.begin(None if streamed else request, context)
            response = await impl(_checked_stream(request, guard.method) if streamed else request, call)
            code = grpc.StatusCode.OK
            return response
        except Exception as exc:
            code = guard.fail(exc, context)
            return None
        finally:
            guard.done(code, started)

    return handle


def _server_stream(guard: _Guard, impl: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
    async def handle(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        started, code = time.perf_counter(), grpc.StatusCode.INTERNAL
        try:
            call = await guard.begin(request, context)
            async for item in impl(request, call):
                yield item
            code = grpc.StatusCode.OK
        except Exception as exc:
            code = guard.fail(exc, context)
        finally:
            guard.done(code, started)

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
) -> grpc.GenericRpcHandler:
    """Returns a generic handler serving every RPC of ``service`` from ``implementation``.

    Raises:
        TypeError: if ``implementation`` lacks a method for one of the service's RPCs.
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        impl = getattr(implementation, method.name, None)
        if impl is None:
            raise TypeError(
                f"{type(implementation).__name__} does not implement {service.name}.{method.name}"
            )
        handlers[method.name] = _handler_for(service, method, impl, authenticate, observer)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def _handler_for(
    service: ServiceDescriptor,
    method: MethodDescriptor,
    impl: Callable[..., Any],
    authenticate: Authenticator,
    observer: RpcObserver | None,
) -> grpc.RpcMethodHandler[Any, Any]:
    logged = tuple(name for name in _LOGGED_FIELDS if name in method.input_type.fields_by_name)
    durations = duration_paths(method.input_type)
    guard = _Guard(service.name, method.name, authenticate, observer, logged, durations)
    request_cls = message_factory.GetMessageClass(method.input_type)
    parse = _deserializer(request_cls)
    if method.client_streaming and not method.server_streaming:
        return grpc.stream_unary_rpc_method_handler(
            _unary(guard, impl, streamed=True), request_deserializer=parse, response_serializer=_serializer
        )
    if method.server_streaming and not method.client_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _server_stream(guard, impl), request_deserializer=parse, response_serializer=_serializer
        )
    if method.client_streaming or method.server_streaming:
        raise TypeError(f"bidirectional streams are not supported ({method.full_name})")
    return grpc.unary_unary_rpc_method_handler(
        _unary(guard, impl, streamed=False), request_deserializer=parse, response_serializer=_serializer
    )


__all__ = [
    "ANONYMOUS",
    "Authenticator",
    "Call",
    "Principal",
    "RpcObserver",
    "method_handlers",
]
