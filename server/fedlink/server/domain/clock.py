"""Time as a dependency: the store and the services ask a Clock, so tests can move time by hand."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Protocol


class Clock(Protocol):
    """Something that tells the current time as a timezone-aware UTC datetime."""

    def now(self) -> datetime:
        """Return the current time (timezone-aware, UTC)."""
        ...


class SystemClock:
    """The wall clock."""

    def now(self) -> datetime:
        """Return the current wall-clock time in UTC."""
        return datetime.now(UTC)


class ManualClock:
    """A clock that only moves when told to: for tests of leases and deadlines without sleeping."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start if start is not None else datetime(2030, 1, 1, tzinfo=UTC)
        if self._now.tzinfo is None:
            raise ValueError("ManualClock needs a timezone-aware start time")

    def now(self) -> datetime:
        """Return the clock's current time."""
        return self._now

    def advance(self, delta: timedelta) -> datetime:
        """Move the clock forward by ``delta`` and return the new time."""
        self._now += delta
        return self._now
