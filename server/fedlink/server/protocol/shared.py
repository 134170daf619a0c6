"""Reads of immutable things (blobs by sha256) shared by concurrent askers and kept a while.

The devices of a round ask for the same model, or report against it, together: the first asker's read
is a future the others await, and its answer is kept for the next ones. A failed read is not kept, so
the next asker tries again. Least recently used answers go first.
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
        self._pending: OrderedDict[str, asyncio.Future[T]] = OrderedDict()

    async def get(self, key: str) -> T:
        pending = self._pending.get(key)
        if pending is None:
            pending = asyncio.ensure_future(self._read(key))
            self._pending[key] = pending
            while len(self._pending) > self._size:
                self._pending.popitem(last=False)
        else:
            self._pending.move_to_end(key)
        try:
            # Shielded: one asker cancelled (its device went away) does not cancel the others' read.
            return await asyncio.shield(pending)
        except Exception:
            if self._pending.get(key) is pending:
                del self._pending[key]
            raise
