"""What a workflow is, and what the coordinator gives it to drive a run.

A workflow does not have to think in rounds: it gets a context with the store, the clock and a way to
wait for progress, and runs until its run is done. The coordinator owns the lifecycle (which run is
driven by whom, restarts, aborts); the workflow owns the run's logic and its checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from fedlink.server.coordination.known_tasks import KnownTasks
from fedlink.server.coordination.notify import TaskNotifier
from fedlink.server.coordination.progress import Progress
from fedlink.server.domain import Clock, Job, Run
from fedlink.server.store import StateStore


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
