"""Coalesces concurrent requests into one store transaction.

A store that commits once per RPC caps the coordinator at the database's single-row transaction rate
(about 2,000/s on PostgreSQL with fsync). Concurrent GetTask claims and result reports instead wait
while one batch is being written and go together in the next one: one commit per batch, so the
throughput grows with concurrency while a lone request still goes straight through.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Req = TypeVar("Req")
Resp = TypeVar("Resp")

#: Handles a batch: one outcome per request, its response or the error to raise to its caller.
BatchHandler = Callable[[Sequence[Req]], Awaitable[Sequence["Resp | BaseException"]]]


class Batcher(Generic[Req, Resp]):
    """Runs ``handler`` on batches of requests, at most one batch at a time.

    ``linger``: while requests arrive together (the last batch had more than one), wait this long
    before taking the next batch, so that it grows. A batch's cost is mostly fixed (a store read's
    thread hops); a lone request goes straight through.

    The handler returns one outcome per request, in order: a response, or an exception that is raised
    to that request's caller alone. If the handler itself raises, every request of the batch gets the
    error.
    """

    def __init__(
        self, handler: BatchHandler[Req, Resp], *, max_batch: int = 256, linger: float = 0.0
    ) -> None:
        self._handler = handler
        self._max_batch = max_batch
        self._linger = linger
        self._pending: list[tuple[Req, asyncio.Future[Resp]]] = []
        self._runner: asyncio.Task[None] | None = None

    async def submit(self, request: Req) -> Resp:
        """Queues ``request`` and returns its response once its batch was handled."""
        future: asyncio.Future[Resp] = asyncio.get_running_loop().create_future()
        self._pending.append((request, future))
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._drain())
        # A caller that gives up cancels its own future only: the batch runs in the drain task, which
        # skips futures that are done (no shield needed, and a shield per call cost a future more).
        try:
            return await future
        finally:
            # An error raised from the future holds this frame in its traceback, and the future holds
            # the error: a reference cycle that kept the request (a report's payload) alive until the
            # cyclic collector ran. Without the frame's references the error is freed with its caller.
            del future, request

    async def _drain(self) -> None:
        company = False  # the last batch had more than one request: callers are arriving together
        while self._pending:
            if company and self._linger > 0 and len(self._pending) < self._max_batch:
                await asyncio.sleep(self._linger)
            batch = self._pending[: self._max_batch]
            del self._pending[: self._max_batch]
            live = [(req, fut) for req, fut in batch if not fut.cancelled()]
            company = len(live) > 1
            if not live:
                continue
            try:
                outcomes = await self._handler([req for req, _ in live])
                if len(outcomes) != len(live):
                    raise RuntimeError(f"batch handler returned {len(outcomes)} outcomes for {len(live)}")
            except Exception as exc:  # every waiter of a failed batch learns why
                for _, fut in live:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for (_, fut), outcome in zip(live, outcomes, strict=True):
                if fut.done():
                    continue
                if isinstance(outcome, BaseException):
                    # Without the handler's frames: an error kept in a list of one of them (as a store
                    # batch keeps its reports' outcomes) is in a reference cycle with that frame, and
                    # raised here its traceback would pull the caller's frames (a report's payload)
                    # into the cycle, kept until the cyclic collector ran.
                    fut.set_exception(outcome.with_traceback(None))
                else:
                    fut.set_result(outcome)

    async def close(self) -> None:
        """Waits for the batch in flight and any queued requests to be handled."""
        if self._runner is not None:
            await self._runner
