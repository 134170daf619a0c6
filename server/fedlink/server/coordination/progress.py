"""How the report path reaches the workflow driving a run, in-process: progress signals and updates.

Every recorded report, release and expiry pokes the run's :class:`Progress`, so its driver reads the
run's state again when something may have changed instead of polling. A driver may also take accepted
updates as they are reported (an :class:`UpdateSink`: FedAvg's streaming fold, a robust rule's buffer),
so that it need not read their payloads back from the store when it closes a round or makes a model.
The store stays the truth: a sink is only ever a head start, and an update it never saw (reported to
another replica, or before a restart) is read from the store.

Replicas on one database: a report recorded on a replica that does not drive its run reaches the
driver's :class:`Progress` too, relayed by PostgreSQL NOTIFY with the reported tasks' ids
(:meth:`Progress.heard`), so that the driver can read those results while the round is still open
rather than all at its close.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

from fedlink.common.dxo import DXO


class UpdateSink(Protocol):
    """Takes a run's validated updates from the report path, in-process, for the driving workflow."""

    def offer(self, task_id: str, request_id: str, update: DXO) -> bool:
        """Offers the validated update of a report about to be recorded; True if the sink holds it.

        :meth:`settle` follows once the store has recorded the report. A sink declines what it cannot
        hold (a task it did not hand out, no room left): that update takes the store's path.
        """
        ...

    def settle(self, task_id: str, request_id: str, *, accepted: bool) -> None:
        """Says what the store made of an offered report: accepted (it counts) or not (drop it)."""
        ...

    async def absorbed(self, task_id: str, *, patience: float) -> None:
        """Returns once the update held for ``task_id`` is used up (at once if none is held), or after
        ``patience`` seconds without progress: a producer of updates (the simulation's virtual devices)
        waits here so that held updates do not pile up beyond the sink's budget."""
        ...


class Progress:
    """Wakes a run's driver when something it waits for may have happened (a result, an expiry)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        #: How many times :meth:`poke` was called (a driver compares two readings: how much happened).
        self.signals = 0
        #: Where the report path hands the run's accepted updates, while the driver takes them.
        self.sink: UpdateSink | None = None
        #: Set by an urgent :meth:`poke`; the driver clears it when it reads the state again.
        self.urgent = False
        #: Told the tasks whose reports another replica recorded, while the driver wants them.
        self.on_reported_elsewhere: Callable[[Sequence[str]], None] | None = None

    def poke(self, *, urgent: bool = False, count: int = 1) -> None:
        """Signals progress (``count`` reports or changes); ``urgent`` when the driver should look at
        once (a lease ran out, the job changed) rather than when enough results came."""
        self.signals += count
        if urgent:
            self.urgent = True
        self._event.set()

    def heard(self, task_ids: Sequence[str], *, urgent: bool = False) -> None:
        """Another replica recorded reports for ``task_ids`` (or, with none, changed the run: a lease
        ran out there): signals once per report, and hands the tasks to whoever wants them."""
        if task_ids and self.on_reported_elsewhere is not None:
            self.on_reported_elsewhere(task_ids)
        self.poke(urgent=urgent, count=max(1, len(task_ids)))

    async def wait(self, seconds: float) -> None:
        """Waits until the next :meth:`poke` or ``seconds``, whichever comes first."""
        if seconds > 0 and not self._event.is_set():
            try:
                async with asyncio.timeout(seconds):
                    await self._event.wait()
            except TimeoutError:
                pass
        self._event.clear()
