"""A scaled clock for simulations: time runs ``scale`` times faster for the coordinator and the virtual
devices alike, so a study of hours of device time runs in minutes and every timeout stays consistent.

The event loop's ``time()`` is the scaled time, and its selector waits ``1/scale`` of every timeout, so
``asyncio.sleep``, ``asyncio.timeout`` and ``call_later`` (the workflows' round and pickup timeouts,
the long polls, the devices' simulated compute times) all run on it; :class:`LoopClock` gives the
coordinator's store the same time as datetimes (leases, deadlines, round start and close). Work done in
threads (the devices' training) takes its real time, which counts ``scale`` times over.
"""

from __future__ import annotations

import asyncio
import math
import selectors
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from fedlink.common.errors import InvalidArgument

__all__ = ["LoopClock", "ScaledEventLoop", "check_time_scale"]


def check_time_scale(scale: float) -> float:
    """``scale`` if it is a finite number >= 1.

    Raises:
        InvalidArgument: it is not.
    """
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale) or scale < 1:
        raise InvalidArgument(f"time_scale must be a number >= 1, not {scale!r}")
    return float(scale)


class _ScaledSelector(selectors.BaseSelector):
    """A selector that waits ``1/scale`` of the (scaled) timeout it is given."""

    def __init__(self, inner: selectors.BaseSelector, scale: float) -> None:
        self._inner, self._scale = inner, scale

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        return self._inner.select(None if timeout is None else timeout / self._scale)

    def close(self) -> None:
        self._inner.close()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self._inner.get_map()


class ScaledEventLoop(asyncio.SelectorEventLoop):
    """An event loop whose time runs ``scale`` times faster than the machine's monotonic clock."""

    def __init__(self, scale: float) -> None:
        self.scale = check_time_scale(scale)
        self._origin = time.monotonic()
        super().__init__(_ScaledSelector(selectors.DefaultSelector(), self.scale))

    def time(self) -> float:
        """Scaled seconds since the loop was made."""
        return (time.monotonic() - self._origin) * self.scale


class LoopClock:
    """The coordinator's Clock on an event loop's time: a scaled loop's time, as UTC datetimes."""

    def __init__(self, loop: asyncio.AbstractEventLoop, start: datetime | None = None) -> None:
        self._loop, self._origin = loop, loop.time()
        self._start = start if start is not None else datetime.now(UTC)

    def now(self) -> datetime:
        """The start time plus the loop's (scaled) seconds since the clock was made."""
        return self._start + timedelta(seconds=self._loop.time() - self._origin)

    def elapsed_s(self) -> float:
        """Seconds of the loop's (scaled) time since the clock was made."""
        return self._loop.time() - self._origin
