"""What a workflow is, and what the coordinator gives it to drive a run.

A workflow does not have to think in rounds: it gets a context with the store, the clock and a way to
wait for progress, and runs until its run is done. The coordinator owns the lifecycle (which run is
driven by whom, restarts, aborts); the workflow owns the run's logic and its checkpoints.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from fedlink.server.domain import Clock, Job, Run
from fedlink.server.protocol.notify import TaskNotifier
from fedlink.server.protocol.reads import KnownTasks
from fedlink.server.store import StateStore
from fedlink.server.workflows.folding import RoundFold


class Progress:
    """Wakes a run's driver when something it waits for may have happened (a result, an expiry)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        #: How many times :meth:`poke` was called (a driver compares two readings: how much happened).
        self.signals = 0
        #: The open round's in-process fold, which the report path hands accepted updates to.
        self.fold: RoundFold | None = None
        #: Set by an urgent :meth:`poke`; the driver clears it when it reads the state again.
        self.urgent = False

    def poke(self, *, urgent: bool = False) -> None:
        """Signals progress; ``urgent`` when the driver should look at once (a lease ran out, the job
        changed) rather than when enough results came."""
        self.signals += 1
        if urgent:
            self.urgent = True
        self._event.set()

    async def wait(self, seconds: float) -> None:
        """Waits until the next :meth:`poke` or ``seconds``, whichever comes first."""
        if seconds > 0 and not self._event.is_set():
            try:
                async with asyncio.timeout(seconds):
                    await self._event.wait()
            except TimeoutError:
                pass
        self._event.clear()


class EventSink(Protocol):
    """Where a workflow reports what happened (job events, metrics)."""

    async def emit(self, job: Job, kind: str, round: int, payload: Mapping[str, Any]) -> None:
        """Records one progress event of ``job``."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowContext:
    """Everything a workflow may use to drive one run."""

    store: StateStore
    clock: Clock
    notifier: TaskNotifier
    progress: Progress
    events: EventSink
    job: Job
    run: Run
    #: Where the tasks the workflow creates go for the device protocol of this process (see KnownTasks).
    known_tasks: KnownTasks = field(default_factory=KnownTasks)


class Workflow(Protocol):
    """Drives one run of a job until it is done."""

    async def run(self, ctx: WorkflowContext) -> None:
        """Runs (or resumes) ``ctx.run`` to the end; raising fails the job with the error."""
        ...


def workflow_name(spec_json: str) -> str:
    """The workflow a job's spec names (e.g. ``"fedavg"``)."""
    spec = json.loads(spec_json)
    name = spec.get("workflow") if isinstance(spec, dict) else None
    return str(name or "")
