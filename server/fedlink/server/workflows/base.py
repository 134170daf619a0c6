"""What a workflow is, and what the coordinator gives it to drive a run.

A workflow does not have to think in rounds: it gets a :class:`WorkflowContext` and runs until its run
is done. The coordinator owns the lifecycle (which run is driven by whom, restarts, aborts); the
workflow owns the run's logic and its checkpoints. The context's methods are the interface a workflow
of one's own uses (``docs/workflows.md``): hand out tasks, wait for progress, read results, checkpoint,
emit events. The built-in workflows also use its ``store`` directly, whose API is the coordinator's own
and may change between releases.

Every run-state write the context makes (tasks, closes, checkpoints) is fenced by the run's lease
(:attr:`WorkflowContext.fence`): once another coordinator took the run over, it raises RunLeaseLost and
changes nothing, and the coordinator stops driving the run without failing its job. A workflow lets
that error through; one writing through ``store`` itself passes ``fence=ctx.fence``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final, Protocol, TypeAlias

from fedlink.common.dxo import DXO
from fedlink.common.errors import FailedPrecondition, InvalidArgument
from fedlink.server.coordination.known_tasks import KnownTasks
from fedlink.server.coordination.notify import TaskNotifier
from fedlink.server.coordination.progress import Progress
from fedlink.server.domain import Clock, Job, Result, Run, RunFence, Task, job_event_json, selector_matches
from fedlink.server.store import NewTask, StateStore


class EventSink(Protocol):
    """Where a workflow reports what happened (job events, metrics)."""

    async def emit(
        self,
        job: Job,
        kind: str,
        round: int,
        payload: Mapping[str, Any],
        *,
        fence: RunFence | None = None,
    ) -> None:
        """Records one progress event of ``job`` (with a ``fence``: only while it holds the run)."""
        ...

    def told(self, job: Job, kind: str, round: int, payload: Mapping[str, Any]) -> None:
        """Passes on an event of ``job`` the caller stored in a write of its own (a checkpoint's)."""
        ...


#: A job event as a workflow makes it: its kind, its round (or model version), its payload.
Event: TypeAlias = tuple[str, int, Mapping[str, Any]]


#: The event kinds a workflow may emit, and what their payload holds (``WatchJob`` has a form for each).
EVENT_KINDS: Final = {
    "round_started": ("num_devices",),
    "round_closed": ("num_results", "metrics"),
    "model_version": ("num_updates", "staleness", "metrics", "selection", "counters"),
}


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

    # ---- the run as it was checkpointed ----
    @property
    def fence(self) -> RunFence:
        """The run's lease as this driver took it: the token every run-state write of this context
        carries (refused with RunLeaseLost once another coordinator took the run over)."""
        return self.run.fence

    @property
    def completed(self) -> int:
        """The rounds (or steps) checkpointed so far: where a resumed run goes on from."""
        return self.run.round

    @property
    def state(self) -> Mapping[str, Any]:
        """The workflow's own JSON state at the last checkpoint (``{}`` before the first)."""
        value = json.loads(self.run.workflow_state_json or "{}")
        return value if isinstance(value, dict) else {}

    async def load_model(self, sha256: str | None = None) -> DXO:
        """A stored model: by default the run's latest (the last checkpoint's, else the job's initial).

        Raises:
            NotFound: no such model.
        """
        sha = sha256 or self.run.global_model_sha256 or self.job.initial_model_sha256
        if sha is None:
            raise InvalidArgument("the job has no initial model")
        return DXO.from_bytes(await self.store.blobs.read(sha))

    # ---- devices and tasks ----
    async def eligible_devices(self) -> list[str]:
        """The online devices the job's device selector admits and that asked for work of the job's name
        (or any job) with GetJob, sorted by id."""
        selector = self.job.device_selector
        online = await self.store.online_devices(with_info=bool(selector), job_name=self.job.name)
        return sorted(device for device, info in online if selector_matches(selector, info))

    async def hand_out(
        self,
        name: str,
        payload: DXO | str,
        devices: Sequence[str],
        *,
        round: int,
        due_in: timedelta,
        model_version: int | None = None,
    ) -> list[Task]:
        """Creates one ``name`` task per device (only that device may take it), carrying ``payload`` (a
        DXO, stored here, or the sha256 of a stored one), due within ``due_in``, and wakes the devices.

        ``model_version`` is the version of the model the payload is, which devices see (see
        GetTaskResponse.model_version). Returns the tasks, in the order of ``devices``.
        """
        if isinstance(payload, DXO):
            payload = (await self.store.blobs.put_bytes(payload.to_bytes())).sha256
        deadline = self.clock.now() + due_in
        created = await self.store.create_tasks(
            [
                NewTask(
                    job_id=self.job.job_id,
                    run_id=self.run.run_id,
                    round=round,
                    name=name,
                    payload_sha256=payload,
                    deadline=deadline,
                    targets=(device,),
                    model_version=model_version,
                )
                for device in devices
            ],
            fence=self.fence,
        )
        self.known_tasks.add(created)
        self.notifier.notify(self.job.job_id, devices)
        return list(created)

    async def wait_for_progress(self, seconds: float) -> None:
        """Waits until something happened to the run (a result, a release, an expired lease, an abort)
        or ``seconds`` passed."""
        await self.progress.wait(seconds)

    async def results(self, tasks: Sequence[Task]) -> list[Result]:
        """The results recorded for ``tasks`` so far (accepted or failed; not late ones), in task order."""
        found: list[Result] = []
        for task in tasks:
            found.extend(
                r
                for r in await self.store.list_results(task_id=task.task_id, accepted_only=False)
                if not r.stale
            )
        return found

    async def read_result(self, result: Result) -> DXO:
        """The DXO a succeeded result carried.

        Raises:
            FailedPrecondition: the result has no payload (it failed, or came late).
        """
        if result.payload_sha256 is None:
            raise FailedPrecondition(f"result {result.result_id} carries no payload ({result.status.value})")
        return DXO.from_bytes(await self.store.blobs.read(result.payload_sha256))

    async def close_tasks(self, tasks: Sequence[Task]) -> None:
        """Closes tasks: reports for them from now on are STALE (recorded, not used)."""
        for task in tasks:
            await self.store.close_task(task.task_id, fence=self.fence)

    # ---- checkpoints and events ----
    async def checkpoint(
        self,
        round: int,
        model: DXO,
        *,
        metrics: Mapping[str, float] | None = None,
        state: Mapping[str, Any] | None = None,
        keep_last: int = 3,
        events: Sequence[Event] = (),
    ) -> str:
        """Stores ``model`` as the run's global model after ``round`` with its metrics and the
        workflow's own JSON ``state``, all in one transaction; returns the model's sha256. A restarted
        coordinator resumes the run from here (:attr:`completed`, :attr:`state`, :meth:`load_model`).

        ``events`` (kind, round, payload, as :meth:`emit` takes them) are recorded in the same
        transaction: a round's ``round_closed`` is there exactly when its checkpoint is.

        Raises:
            InvalidArgument: an event of an unknown kind, or with payload keys it does not have.
        """
        for kind, _, payload in events:
            _check_event(kind, payload)
        ref = await self.store.blobs.put_bytes(model.to_bytes())
        await self.save_checkpoint(
            round,
            ref.sha256,
            json.dumps(dict(metrics or {}), sort_keys=True),
            keep_last=max(1, keep_last),
            state_json=json.dumps(dict(state or {}), sort_keys=True),
            events=events,
        )
        return ref.sha256

    async def save_checkpoint(
        self,
        round: int,
        model_sha256: str,
        metrics_json: str,
        *,
        keep_last: int,
        state_json: str = "{}",
        state_sha256: str | None = None,
        events: Sequence[Event] = (),
    ) -> None:
        """The fenced checkpoint write of :meth:`checkpoint`, for a model already stored, with the
        ``events`` that report it in the same transaction (recorded exactly when the checkpoint is;
        refused with it once the job has ended), passed on to the job's watchers after.

        Raises:
            InvalidArgument: an event of an unknown kind, or with payload keys it does not have.
        """
        for kind, _, payload in events:
            _check_event(kind, payload)
        await self.store.save_checkpoint(
            self.run.run_id,
            round,
            model_sha256,
            metrics_json,
            keep_last=keep_last,
            state_json=state_json,
            state_sha256=state_sha256,
            fence=self.fence,
            events=[(kind, job_event_json(number, payload)) for kind, number, payload in events],
        )
        for kind, number, payload in events:
            self.events.told(self.job, kind, number, payload)

    async def emit(self, kind: str, round: int, payload: Mapping[str, Any]) -> None:
        """Records a progress event that ``fedlink job watch`` shows (a kind of :data:`EVENT_KINDS`).

        Raises:
            InvalidArgument: an unknown kind, or payload keys it does not have.
        """
        _check_event(kind, payload)
        await self.events.emit(self.job, kind, round, payload, fence=self.fence)


def _check_event(kind: str, payload: Mapping[str, Any]) -> None:
    """InvalidArgument unless ``kind`` is one of :data:`EVENT_KINDS` and ``payload`` has only its keys."""
    allowed = EVENT_KINDS.get(kind)
    if allowed is None:
        raise InvalidArgument(f"unknown event kind {kind!r}; known: {', '.join(EVENT_KINDS)}")
    extra = sorted(set(payload) - set(allowed))
    if extra:
        raise InvalidArgument(f"a {kind} event has {', '.join(allowed)}, not {', '.join(extra)}")


class Workflow(Protocol):
    """Drives one run of a job until it is done."""

    async def run(self, ctx: WorkflowContext) -> None:
        """Runs (or resumes) ``ctx.run`` to the end; raising fails the job with the error."""
        ...
