"""A result's payload parsed, checked and decoded off the event loop when it is large or many-tensored.

Everything the coordinator serves runs on one event loop, health checks included. Decoding a 3.2 MB
result of 100,000 one-element tensors took 1.3 s of Python there, checking it 0.7 s more, and 4.75 s
in all before this module: every other call waited. Here a payload of :data:`OFF_LOOP_BYTES` or more
is parsed (a slice of fields at a time, see :mod:`fedlink.common.wire_slices`), checked against its
task and decoded in a worker thread. The thread runs Python and the loop takes the GIL back at least
every switch interval (5 ms); numpy's large copies and hashing let go of it altogether. Smaller
payloads (the 100-float updates of a large fleet) decode in less time than a thread hop costs, and
stay on the loop.

There is one worker thread per coordinator, not a pool: a second thread holding the GIL would only
make the loop wait longer for it, and a device that sends much gets its replies later, not more of
the coordinator. A payload waiting for the thread holds its bytes; how many such calls there can be
is bounded by the server's concurrent streams.

An error raised in the thread comes back as the same exception with its traceback cleared (the
thread's frames hold the payload and what was parsed of it): a refused payload is freed as soon as its
call ends, by reference counting, never waiting for the cyclic collector. A second after large
payloads were handled, the allocator is asked to give the freed memory back to the operating system
(:func:`~fedlink.server.memory.release_soon`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Final, TypeVar

from fedlink.common.dxo import DXO
from fedlink.common.dxo_outline import DeclaredDxo
from fedlink.common.errors import FedlinkError, InvalidArgument, ResourceExhausted
from fedlink.common.wire_slices import SLICE_BYTES, count_fields
from fedlink.server.memory import release_soon
from fedlink.server.protocol.results import ResultChecks

__all__ = ["OFF_LOOP_BYTES", "OFF_LOOP_TENSORS", "TENSOR_SLACK", "Declared", "ResultDecoder"]

#: Payloads of this size or more are parsed and checked in the worker thread.
OFF_LOOP_BYTES: Final[int] = 16 * 1024
#: Payloads that declare this many tensors or more, or (:data:`OFF_LOOP_BYTES`) as many decoded
#: bytes, are decoded and validated in the worker thread.
OFF_LOOP_TENSORS: Final[int] = 256
#: A payload with this many tensors more than an answer to its task may carry is refused unparsed.
TENSOR_SLACK: Final[int] = 256
_DATA_FIELD: Final[int] = 2  # fedlink.v1.Dxo.data

T = TypeVar("T")


class Declared:
    """A payload parsed and checked by what it declares: the message, and the bytes it decodes to."""

    __slots__ = ("decoded_nbytes", "dxo", "off_loop")

    def __init__(self, dxo: DeclaredDxo, decoded_nbytes: int, off_loop: bool) -> None:
        self.dxo = dxo
        self.decoded_nbytes = decoded_nbytes
        #: Whether decoding it belongs in the worker thread too.
        self.off_loop = off_loop


class ResultDecoder:
    """Runs the parse, check and decode steps of result payloads, in one worker thread when large."""

    def __init__(self) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Stops the worker thread (after the step it runs); later steps start another."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    async def declare(self, data: bytes, checks: ResultChecks, max_decoded_bytes: int) -> Declared:
        """Parses ``data`` and checks what it declares: its structure, its tensors against the task,
        and that it decodes to at most ``max_decoded_bytes``. Nothing is decoded.

        Raises:
            InvalidArgument: Not a valid DXO, or not one that answers the task.
            ResourceExhausted: It would decode to more than ``max_decoded_bytes``.
        """
        if len(data) < OFF_LOOP_BYTES:
            return _declare(data, checks, max_decoded_bytes, None)
        return await self._run(_declare, data, checks, max_decoded_bytes, SLICE_BYTES)

    async def decode(self, declared: Declared, checks: ResultChecks) -> tuple[DXO, bytes]:
        """Decodes a declared payload and validates its values; returns the DXO and its canonical bytes
        (what is stored and hashed: the same for the same DXO however its sender ordered it).

        Raises:
            InvalidArgument: As :meth:`ResultChecks.validate`.
        """
        if not declared.off_loop:
            return _decode(declared.dxo, checks)
        return await self._run(_decode, declared.dxo, checks)

    async def _run(self, step: Callable[..., T], *args: object) -> T:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fedlink-decode")
        loop = asyncio.get_running_loop()
        outcome = await loop.run_in_executor(self._executor, _caught, step, *args)
        release_soon()
        if not isinstance(outcome, _Refused):
            return outcome
        error = outcome.error
        del outcome
        try:
            raise error
        finally:
            # The error's traceback holds this frame: a local naming the error would make a cycle,
            # and every frame up to the call's handler (the payload's bytes with them) would wait in it
            # for the cyclic collector.
            del error


class _Refused:
    """A step's error, carried back from the thread without the frames that raised it."""

    __slots__ = ("error",)

    def __init__(self, error: FedlinkError) -> None:
        self.error = error


def _caught(step: Callable[..., T], *args: object) -> T | _Refused:
    try:
        return step(*args)
    except FedlinkError as error:
        # Its traceback holds this thread's frames, and they the payload: drop them.
        error.__traceback__ = None
        error.__context__ = error.__cause__ = None
        return _Refused(error)


def _declare(data: bytes, checks: ResultChecks, max_decoded_bytes: int, slice_bytes: int | None) -> Declared:
    bound, why = checks.tensor_bound()
    # Parsing a map of 100,000 entries holds the GIL for 70 ms at a time as it grows: one with far more
    # tensors than an answer may have is refused before any of it is parsed. (A few too many are
    # parsed, and the check of what they declare names the first one that is wrong.)
    most = bound + TENSOR_SLACK
    count = count_fields(data, _DATA_FIELD, most)
    if count is not None and count > most:
        raise InvalidArgument(f"the result carries more than {most} tensors; {why}")
    dxo = DeclaredDxo.parse(data, slice_bytes=slice_bytes)
    checks.check_declared(dxo)
    decoded = dxo.decoded_nbytes()
    if decoded > max_decoded_bytes:
        raise ResourceExhausted(
            f"the result would decode to {decoded} bytes, over the limit of {max_decoded_bytes}"
        )
    off_loop = slice_bytes is not None or decoded >= OFF_LOOP_BYTES or dxo.tensor_count() >= OFF_LOOP_TENSORS
    return Declared(dxo, decoded, off_loop)


def _decode(dxo: DeclaredDxo, checks: ResultChecks) -> tuple[DXO, bytes]:
    update = dxo.decode()
    checks.validate(update)
    return update, dxo.canonical_bytes()
