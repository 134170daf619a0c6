"""The coordinator's background loops, under one owner.

The job supervisor's scan, the maintenance tick and the metrics refresh each run as a :class:`Loop`: a
step, then a pause, forever. A step that raises is logged and tried again after a backoff (doubling
from ``first_backoff`` to ``max_backoff``, with jitter): a dropped database connection or a locked
table costs a few seconds, not the loop. A loop whose steps have failed without a success for
``give_up_after`` is not recovering: it raises :class:`LoopGaveUp`, the task group cancels the other
loops, and the owner is told (:meth:`BackgroundLoops.run` raises), so that the coordinator turns
health NOT_SERVING and stops with a non-zero exit instead of answering RPCs while driving no job.

A failure the policy says to ride out (``LoopPolicy.ride_out``: the store being unreachable) is waited
out however long it lasts, retried with the same backoff (at most ``ride_out_every`` apart), and never
counts towards giving up: the store's own availability turns health NOT_SERVING meanwhile, and the
loop carries on once it is back.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta

from fedlink.common.errors import FedlinkError

log = logging.getLogger(__name__)


class LoopGaveUp(FedlinkError):
    """A background loop kept failing for longer than it may."""

    def __init__(self, name: str, seconds: float, cause: BaseException) -> None:
        super().__init__(
            f"background loop {name!r} failed for {seconds:.0f}s without recovering; last error: "
            f"{type(cause).__name__}: {cause}"
        )
        self.loop_name = name


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopPolicy:
    """How a failing loop retries, and when it gives up."""

    #: The wait after a first failure.
    first_backoff: timedelta = timedelta(milliseconds=200)
    #: The longest wait between two tries.
    max_backoff: timedelta = timedelta(seconds=10)
    #: How long a loop may go on failing (no successful step) before it gives up.
    give_up_after: timedelta = timedelta(minutes=2)
    #: Which failures are waited out without giving up, however long they last (an outage of the
    #: store, which the coordinator's health reports meanwhile): none by default.
    ride_out: Callable[[BaseException], bool] = field(default=lambda exc: False)
    #: The longest wait between two tries while riding out a failure: each try fails at once while the
    #: store is away, and the loop carries on within this of its return.
    ride_out_every: timedelta = timedelta(seconds=1)


@dataclass(slots=True)
class Loop:
    """One background loop: ``step`` then ``pause``, forever; ``close`` once it ends."""

    name: str
    step: Callable[[], Awaitable[None]]
    pause: Callable[[], Awaitable[None]]
    close: Callable[[], Awaitable[None]] | None = None
    #: Consecutive failed steps (0 after a success).
    failures: int = field(default=0, init=False)

    async def run(self, policy: LoopPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        """Runs until cancelled; raises :class:`LoopGaveUp` if its steps keep failing."""
        failing_since: float | None = None
        try:
            while True:
                try:
                    await self.step()
                except Exception as exc:
                    if policy.ride_out(exc):
                        await self._wait_out(policy, exc)
                        continue
                    now = clock()
                    failing_since = now if failing_since is None else failing_since
                    self.failures += 1
                    if now - failing_since >= policy.give_up_after.total_seconds():
                        raise LoopGaveUp(self.name, now - failing_since, exc) from exc
                    wait = _backoff(policy, self.failures)
                    log.exception(
                        "background loop %s failed (%d in a row); retrying in %.1fs",
                        self.name,
                        self.failures,
                        wait,
                        extra={"loop": self.name, "failures": self.failures},
                    )
                    await asyncio.sleep(wait)
                    continue
                if failing_since is not None or self.failures:
                    log.info("background loop %s recovered", self.name, extra={"loop": self.name})
                failing_since, self.failures = None, 0
                await self.pause()
        finally:
            if self.close is not None:
                await self.close()

    async def _wait_out(self, policy: LoopPolicy, exc: Exception) -> None:
        """Backs off after a failure to ride out (logged without a traceback: it says nothing new)."""
        self.failures += 1
        wait = min(_backoff(policy, self.failures), policy.ride_out_every.total_seconds())
        level = logging.WARNING if self.failures == 1 else logging.DEBUG
        log.log(
            level,
            "background loop %s waits out an outage (%s); retrying in %.1fs",
            self.name,
            exc,
            wait,
            extra={"loop": self.name, "failures": self.failures},
        )
        await asyncio.sleep(wait)


def _backoff(policy: LoopPolicy, failures: int) -> float:
    first, cap = policy.first_backoff.total_seconds(), policy.max_backoff.total_seconds()
    base = min(cap, first * 2 ** min(failures - 1, 30))
    # Jitter: replicas that failed together do not retry together.
    return float(base * random.uniform(0.5, 1.0))


class BackgroundLoops:
    """Runs the coordinator's loops in one task group: ``await loops.run()`` until cancelled.

    Raises out of :meth:`run` when a loop gives up (the others are cancelled first).
    """

    def __init__(self, policy: LoopPolicy | None = None) -> None:
        self.policy = policy or LoopPolicy()
        self._loops: list[Loop] = []

    def add(self, loop: Loop) -> None:
        """Adds a loop (before :meth:`run`)."""
        self._loops.append(loop)

    @property
    def loops(self) -> tuple[Loop, ...]:
        """The loops, in the order they were added."""
        return tuple(self._loops)

    async def run(self) -> None:
        """Runs every loop until cancelled.

        Raises:
            LoopGaveUp: a loop did not recover (the first one to give up).
        """
        try:
            async with asyncio.TaskGroup() as group:
                for loop in self._loops:
                    group.create_task(loop.run(self.policy), name=f"loop-{loop.name}")
        except BaseExceptionGroup as group_error:
            gave_up = group_error.subgroup(LoopGaveUp)
            if gave_up is not None:
                raise gave_up.exceptions[0] from None
            raise
