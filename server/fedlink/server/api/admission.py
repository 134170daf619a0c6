"""Reading request bodies only once the caller may send them: authenticated first, or few and small.

grpc reads a unary call's whole request (up to the server's ``grpc.max_receive_message_length``, 64 MiB
by default) before its handler runs, and has no per-method limit on the server side: a method config's
``maxRequestMessageBytes`` is a client's service config, and the server's limit is one channel argument
for every method. Four unauthenticated 64 MiB calls at once cost the coordinator +348 MB before they
were refused. A method served as a *stream* of requests, though, reads nothing until its handler asks
(grpc only buffers the HTTP/2 flow-control window, some KiB): the coordinator's handlers are all served
that way (see :mod:`fedlink.server.api.rpc`), authenticate the caller from its metadata, and only then
read the body. A caller without a valid credential is refused with its body unread.

Calls that need no credential (``Enroll``, the health service) must be read to be served. Those go
through :class:`UnauthenticatedReads`: at most ``slots`` such bodies are read at once per gate (the
others wait up to ``slot_timeout`` for their turn, then are refused unread), each must arrive within
``read_timeout``, and one above ``max_bytes`` is refused with RESOURCE_EXHAUSTED before it is parsed.
What is left: grpc holds a body it hands over about three times over while it does (a 64 MiB
``Enroll`` costs ~190 MiB for a moment, and 100 to 150 ms of the event loop); only the server's
message limit (``max_message_bytes``), which is one for every method, bounds that.

A device is authenticated before its body is read, so a device that keeps sending what is refused can
be stopped before the next one is read: :class:`RefusedBytes`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from fedlink.common.errors import FedlinkError, InvalidArgument, ResourceExhausted
from fedlink.server.api.errors import status_code_for
from fedlink.server.memory import release_soon

__all__ = ["RefusedBytes", "UnauthenticatedReads", "gated_health_handler", "read_body"]

#: What an unauthenticated request may be: an enrolment (ids, device_info and user_info) or a health
#: check needs far less.
UNAUTHENTICATED_MESSAGE_BYTES = 64 * 1024


async def read_body(context: grpc.aio.ServicerContext[Any, Any], method: str) -> bytes:
    """The call's one request message, as bytes (the handler's deserializer is the identity).

    Raises:
        InvalidArgument: The client closed the stream without sending a message.
    """
    data = await context.read()
    if data is grpc.aio.EOF:
        raise InvalidArgument(f"{method}: the call carries no request message")
    assert isinstance(data, bytes)
    return data


@dataclass(slots=True)
class UnauthenticatedReads:
    """Bounds the request bodies read from callers that present no credential (see the module doc).

    One instance is one gate: its slots are shared by the methods given it.
    """

    #: Bodies read at once; other unauthenticated callers wait for a slot (``slot_timeout``).
    slots: int = 1
    #: Largest body accepted; a larger one is refused (RESOURCE_EXHAUSTED) once read, never parsed.
    max_bytes: int = UNAUTHENTICATED_MESSAGE_BYTES
    #: How long a body may take to arrive once its slot is free (a slow sender holds a slot).
    read_timeout: timedelta = timedelta(seconds=5)
    #: How long a caller waits for a slot before it is refused (RESOURCE_EXHAUSTED, retry_after),
    #: unread. A small body holds its slot for well under a millisecond, a 64 MiB one 150 ms or more.
    slot_timeout: timedelta = timedelta(seconds=2)
    _gate: asyncio.Semaphore | None = None

    async def read(self, context: grpc.aio.ServicerContext[Any, Any], method: str) -> bytes:
        """Reads the call's request body in turn with the gate's other callers.

        Raises:
            ResourceExhausted: The body is larger than :attr:`max_bytes`, or did not arrive in time.
            InvalidArgument: There is no request message.
        """
        if self._gate is None:  # made on first use: a Semaphore belongs to the loop that uses it
            self._gate = asyncio.Semaphore(self.slots)
        try:
            async with asyncio.timeout(self.slot_timeout.total_seconds()):
                await self._gate.acquire()
        except TimeoutError:
            raise ResourceExhausted(
                f"{method}: too many calls without a credential are being read; try again shortly",
                retry_after=timedelta(seconds=1),
            ) from None
        try:
            try:
                async with asyncio.timeout(self.read_timeout.total_seconds()):
                    data = await read_body(context, method)
            except TimeoutError:
                raise ResourceExhausted(
                    f"{method}: the request did not arrive within {self.read_timeout.total_seconds():g}s"
                ) from None
        finally:
            self._gate.release()
        size = len(data)
        if size > self.max_bytes:
            del data  # not kept alive by the error's traceback
            release_soon()
            raise ResourceExhausted(
                f"{method}: the request is {size} bytes; a call without a credential may send at most "
                f"{self.max_bytes}"
            )
        return data


def gated_health_handler(servicer: Any, reads: UnauthenticatedReads) -> grpc.GenericRpcHandler:
    """grpc's health service (``grpc.health.v1.Health``) with its requests read through ``reads``.

    Args:
        servicer: A ``grpc_health.v1.health.aio.HealthServicer``.
        reads: The gate its (unauthenticated) requests are read through.
    """
    parse: Callable[[bytes], health_pb2.HealthCheckRequest] = health_pb2.HealthCheckRequest.FromString

    async def request(
        context: grpc.aio.ServicerContext[Any, Any], method: str
    ) -> health_pb2.HealthCheckRequest | None:
        """The request, or None with the call's status set (not ``abort()``: see rpc.py's ``fail``)."""
        try:
            data = await reads.read(context, method)
            try:
                return parse(data)
            except Exception:
                raise InvalidArgument(f"{method}: the request is not a valid protobuf message") from None
        except FedlinkError as error:
            context.set_code(status_code_for(error))
            context.set_details(error.message)
            return None

    async def check(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        checked = await request(context, "Check")
        return None if checked is None else await servicer.Check(checked, context)

    async def watch(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]) -> None:
        watched = await request(context, "Watch")
        if watched is not None:
            await servicer.Watch(watched, context)

    serialize = health_pb2.HealthCheckResponse.SerializeToString
    return grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health",
        {
            "Check": grpc.stream_unary_rpc_method_handler(check, response_serializer=serialize),
            "Watch": grpc.stream_stream_rpc_method_handler(watch, response_serializer=serialize),
        },
    )


#: Refusals that a device's request earned by what it sent (its payload, its conflicting replay).
_REFUSED_FOR_CONTENT = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


@dataclass(slots=True)
class RefusedBytes:
    """How many bytes of refused requests each device may make the coordinator read: a token bucket.

    A request is read only after its caller is authenticated, so a device that keeps sending what is
    refused (a payload that does not fit its task, a different result for a completed assignment) can
    be stopped before its next body is read: each refused request costs its device its size; a
    device in deficit gets RESOURCE_EXHAUSTED, with when to try again, unread. Copying a body out of
    grpc alone costs the event loop about 2.4 ms per MiB, so without this ten devices sending refused
    4 MiB reports as fast as they are answered kept the loop a third busy. A device whose results are
    accepted is never charged.
    """

    #: What a device may have refused at once.
    burst_bytes: int = 64 * 1024 * 1024
    #: How fast a device's allowance comes back.
    refill_bytes_per_s: float = 4 * 1024 * 1024
    #: Devices tracked at most (the least recently charged are forgotten first).
    max_devices: int = 100_000
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict, repr=False)

    def check(self, device_id: str, method: str) -> None:
        """Raises ResourceExhausted (with retry_after) if the device is in deficit."""
        bucket = self._buckets.get(device_id)
        if bucket is None:
            return
        tokens = self._refilled(bucket)
        if tokens >= 0:
            return
        wait = -tokens / self.refill_bytes_per_s
        raise ResourceExhausted(
            f"{method}: this device sent {self.burst_bytes - tokens:.0f} bytes of requests that were refused "
            f"lately; its requests are read again in {wait:.1f}s",
            retry_after=timedelta(seconds=wait),
        )

    def charge(self, device_id: str, code: grpc.StatusCode, request_bytes: int) -> None:
        """Counts a finished request of the device against it if it was refused for its content."""
        if code not in _REFUSED_FOR_CONTENT or request_bytes <= 0:
            return
        bucket = self._buckets.pop(device_id, None)
        tokens = self.burst_bytes if bucket is None else self._refilled(bucket)
        self._buckets[device_id] = (tokens - request_bytes, self.clock())
        if len(self._buckets) > self.max_devices:
            self._buckets.pop(next(iter(self._buckets)))

    def _refilled(self, bucket: tuple[float, float]) -> float:
        tokens, at = bucket
        return min(float(self.burst_bytes), tokens + (self.clock() - at) * self.refill_bytes_per_s)
