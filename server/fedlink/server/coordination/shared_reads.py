"""Reads of immutable things (blobs by sha256) shared by concurrent askers and kept a while.

The devices of a round ask for the same model, or report against it, together: the first asker reads,
the others await its answer, and the answer is kept for the next ones. A failed read is not kept, so
the next asker tries again. Least recently used answers go first.

The read runs in the first asker's own task, never in a task of its own: when the coordinator stops
and its callers are cancelled, no read is left running behind them (a detached read outlived its event
loop in a test run). If that asker is cancelled, a waiting one takes the read over.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SharedReads(Generic[T]):
    """``get(key)`` runs ``read(key)`` once for all concurrent and later askers, keeping ``size`` answers."""

    def __init__(self, read: Callable[[str], Awaitable[T]], size: int) -> None:
        self._read = read
        self._size = size
        self._answers: OrderedDict[str, asyncio.Future[T]] = OrderedDict()

    async def get(self, key: str) -> T:
        while True:
            answer = self._answers.get(key)
            if answer is None:
                return await self._read_for_all(key)
            self._answers.move_to_end(key)
            try:
                # Shielded: this asker cancelled (its device went away) does not cancel the answer.
                return await asyncio.shield(answer)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if answer.cancelled() and (task is None or not task.cancelling()):
                    continue  # the reader was cancelled, not this asker: read it here
                raise

    async def _read_for_all(self, key: str) -> T:
        answer: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._answers[key] = answer
        while len(self._answers) > self._size:
            self._answers.popitem(last=False)
        try:
            value = await self._read(key)
        except BaseException as exc:
            if self._answers.get(key) is answer:
                del self._answers[key]  # not kept: the next asker reads again
            if isinstance(exc, asyncio.CancelledError):
                answer.cancel()  # the waiting askers take over
            else:
                answer.set_exception(exc)
                answer.exception()  # retrieved: the waiters, if any, raise it themselves
            raise
        answer.set_result(value)
        return value
