"""Riding out a database that drops its connections or goes away for a while.

PostgreSQL connections break: a restart or a failover terminates them, so does an operator's
``pg_terminate_backend``, and a network blip resets them. The store hides that from its callers
(:class:`~fedlink.server.store.dialect.Database` applies these rules):

* A pooled connection the server closed while it sat idle is replaced when it is checked out (the
  driver knows it is closed: no round trip is spent asking).
* A write transaction whose connection broke before its commit was rolled back by the server: it runs
  again, whole, on a fresh connection. One whose connection broke *during* its commit may have
  committed: its transaction id, read just before the commit, says which (``pg_xact_status``). If it
  committed, the result it computed is returned; if not, it runs again. A write is applied once. (Reading
  the id is one more round trip per write transaction, small beside the commit's own flush; the hot
  path's writes are batched.)
* A read whose connection broke runs again, as a whole store call (:func:`retry_reads` lists them).
* Retries back off (doubling, with jitter) within a budget (:attr:`StoreRetryPolicy.budget`). A call
  still failing when it is spent raises :class:`StoreUnavailable`, with ``retry_after``: the store is
  then *away* (:class:`StoreAvailability`), and every call fails at once, without a budget of its own,
  until one succeeds again (the coordinator probes every second). Devices get UNAVAILABLE with that
  ``retry_after``, health says NOT_SERVING, and the background loops wait it out.

Until the database has answered once nothing is retried: a wrong URL or a server that is down when the
coordinator starts fails at once, with the driver's own error. SQLite files do not drop connections;
a locked SQLite database stays :class:`~fedlink.common.errors.Unavailable` as before.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import sqlalchemy as sa

from fedlink.common.errors import Unavailable

log = logging.getLogger(__name__)

_C = TypeVar("_C", bound=type)

#: SQLSTATEs (besides class 08, "connection exception") that say the server dropped or refused the
#: connection, not that the statement was wrong: admin_shutdown (pg_terminate_backend, a fast shutdown),
#: crash_shutdown, cannot_connect_now (starting up or in recovery), too_many_connections.
_CONNECTION_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "53300"})


class StoreUnavailable(Unavailable):
    """The database cannot be used now: it is unreachable, or kept dropping the connection for longer
    than the retry budget. Nothing is known to be lost: retry after ``retry_after``."""


class ConnectionLost(StoreUnavailable):
    """A connection broke in the middle of a read: the read can run again on a fresh one
    (:func:`retry_reads` does that for the store's read methods)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreRetryPolicy:
    """How a store call retries after its database connection broke."""

    #: How long one call goes on retrying (reconnecting, running its transaction again) before it
    #: raises :class:`StoreUnavailable` and the store counts as away.
    budget: timedelta = timedelta(seconds=10)
    #: The wait after a first broken connection; doubled per retry (with jitter) up to ``max_backoff``.
    first_backoff: timedelta = timedelta(milliseconds=20)
    #: The longest wait between two attempts.
    max_backoff: timedelta = timedelta(seconds=1)
    #: What callers are told to wait (``retry_after``) while the store is away.
    retry_after: timedelta = timedelta(seconds=2)


def sqlstate(exc: BaseException) -> str | None:
    """The PostgreSQL SQLSTATE of a database error (SQLAlchemy's, or the driver's under it), if any."""
    orig = getattr(exc, "orig", None)
    for candidate in (exc, orig, getattr(orig, "__cause__", None)):
        code = getattr(candidate, "sqlstate", None) or getattr(candidate, "pgcode", None)
        if isinstance(code, str):
            return code
    return None


def is_connection_loss(exc: BaseException) -> bool:
    """True for an error that says the connection to the database broke or could not be made, not that
    the work was wrong: the same work may succeed on a fresh connection."""
    if isinstance(exc, ConnectionLost | ConnectionError | TimeoutError | socket.gaierror):
        return True
    if isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated:
        return True
    state = sqlstate(exc)
    return state is not None and (state.startswith("08") or state in _CONNECTION_SQLSTATES)


def is_store_away(exc: BaseException) -> bool:
    """True for an error that says the store cannot be used now (and may be later): what the
    coordinator's background loops wait out rather than give up on."""
    return isinstance(exc, StoreUnavailable) or is_connection_loss(exc)


def is_connect_failure(exc: BaseException) -> bool:
    """True for an error raised while opening a connection: whatever it says (refused, no such host, the
    database not accepting connections), the database cannot be used now."""
    return is_connection_loss(exc) or isinstance(exc, OSError | sa.exc.DBAPIError)


def describe(exc: BaseException) -> str:
    """A one-line account of a database error for the coordinator's log (never sent to devices)."""
    cause = getattr(exc, "orig", None) or exc
    first = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {first[0]}" if first else type(cause).__name__


class StoreAvailability:
    """Whether the store answers: *away* from a call that spent its retry budget until a call succeeds.

    Listeners (the coordinator's health) are told every change, with the new state.
    """

    def __init__(self) -> None:
        #: False while the store is away.
        self.available = True
        self._away_since = 0.0
        self._listeners: list[Callable[[bool], None]] = []

    def subscribe(self, listener: Callable[[bool], None]) -> None:
        """Calls ``listener(available)`` at every change from now on."""
        self._listeners.append(listener)

    def went_away(self, cause: BaseException) -> None:
        """A call spent its budget: the store is away (logged once per outage)."""
        if not self.available:
            return
        self.available = False
        self._away_since = time.monotonic()
        log.error(
            "the database is unreachable (%s): store calls fail with UNAVAILABLE until it answers again",
            describe(cause),
        )
        self._tell(False)

    def came_back(self) -> None:
        """A call succeeded: the store is available (again)."""
        if self.available:
            return
        self.available = True
        log.warning("the database answers again after %.1fs away", time.monotonic() - self._away_since)
        self._tell(True)

    def _tell(self, available: bool) -> None:
        for listener in list(self._listeners):
            try:
                listener(available)
            except Exception:  # one listener's bug must not stop the store from recovering
                log.exception("a store availability listener failed")


class RetryBudget:
    """One store call's retries of broken connections: the backoff, and the budget they may spend."""

    def __init__(self, policy: StoreRetryPolicy, availability: StoreAvailability) -> None:
        self._policy = policy
        self._availability = availability
        self._deadline: float | None = None
        self._failures = 0

    async def spend(self, cause: BaseException, what: str) -> None:
        """Waits before the next attempt after ``cause`` broke the call while ``what`` (e.g. "reading").

        Raises:
            StoreUnavailable: the budget is spent (at once while the store is away); the store is
                marked away.
        """
        policy, now = self._policy, time.monotonic()
        if self._deadline is None:
            budget = policy.budget.total_seconds() if self._availability.available else 0.0
            self._deadline = now + budget
        if not self._availability.available or now >= self._deadline:
            self._availability.went_away(cause)
            seconds = policy.retry_after.total_seconds()
            raise StoreUnavailable(
                f"the coordinator's database is unavailable ({type(cause).__name__} while {what}); "
                f"retry in {seconds:g}s",
                retry_after=policy.retry_after,
            ) from cause
        self._failures += 1
        first, cap = policy.first_backoff.total_seconds(), policy.max_backoff.total_seconds()
        # Jitter: the calls a termination broke together do not all come back in the same instant.
        delay = min(cap, first * 2 ** min(self._failures - 1, 30)) * random.uniform(0.5, 1.0)
        level = logging.WARNING if self._failures == 1 else logging.DEBUG
        log.log(level, "the database connection failed while %s (%s); retrying", what, describe(cause))
        await asyncio.sleep(min(delay, self._deadline - now))


def retry_reads(*names: str) -> Callable[[_C], _C]:
    """Class decorator: the read-only methods ``names`` run again, whole, when their connection broke.

    Only for methods that write nothing: a read is safe to repeat; a write retries inside its own
    transaction (see the module docstring). The class's instances keep their database in ``_db``.
    """

    def apply(cls: _C) -> _C:
        for name in names:
            setattr(cls, name, _retried(getattr(cls, name)))
        return cls

    return apply


def _retried(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await self._db.reading(lambda: method(self, *args, **kwargs))

    return call
