"""The control protocol (ControlService) in domain terms: jobs, devices and models for operators."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from fedlink.common.dxo import DataKind
from fedlink.common.errors import FailedPrecondition, IllegalTransition, InvalidArgument, NotFound
from fedlink.common.json_limits import load_json
from fedlink.runner.validation import check_job_data as check_components
from fedlink.server.coordination.model_outlines import ModelOutlines
from fedlink.server.coordination.notify import TaskNotifier
from fedlink.server.coordination.workflow_catalog import WorkflowCatalog
from fedlink.server.domain import (
    Device,
    DeviceState,
    Job,
    JobEvent,
    JobState,
    Run,
    RunState,
    WorkflowSpec,
    is_final,
)
from fedlink.server.protocol.events import JobEvents
from fedlink.server.protocol.transfers import check_sha256
from fedlink.server.store import NewJob, Page, StateStore

_MAX_NAME = 128
#: Largest job_data accepted: a runner configuration of components, a few KiB in practice.
MAX_JOB_DATA_BYTES = 1024 * 1024
_SUBMIT_SCOPE = "control.submit_job"


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSubmission:
    """What an operator submits."""

    name: str
    #: The workflow and its parameters (checked by the coordinator's workflow catalog).
    workflow: WorkflowSpec
    job_data: str
    initial_model_sha256: str
    #: The initial model's size as the submitter says it; 0 means "not said".
    initial_model_size_bytes: int = 0
    device_selector: Mapping[str, str]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobView:
    """A job with its progress, as operators see it."""

    job: Job
    #: The round in progress; once the job is final, the round it ended in; 0 while PENDING.
    current_round: int
    #: Rounds closed (their models checkpointed) so far.
    completed_rounds: int
    metrics: Mapping[str, float]


def current_round(job: Job, completed: int, num_steps: int) -> int:
    """The round a job is in, given the rounds it completed and how many it runs to (0: unknown)."""
    if job.state is JobState.PENDING:
        return 0
    if job.state is JobState.FINISHED or (num_steps and completed >= num_steps):
        return completed
    return completed + 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelLocation:
    """Where a job's model of some round is."""

    sha256: str
    round: int


def check_job_data(job_data: str) -> None:
    """Checks that ``job_data`` is a JSON object of at most :data:`MAX_JOB_DATA_BYTES` nesting at most
    :data:`~fedlink.common.json_limits.MAX_JSON_DEPTH` deep (the runner checks its components)."""
    if not job_data:
        return
    doc = load_json(job_data, what="job_data", max_bytes=MAX_JOB_DATA_BYTES, strict=False)
    if not isinstance(doc, dict):
        raise InvalidArgument("job_data must be a JSON object")


class ControlProtocol:
    """Serves the operator RPCs against the store."""

    def __init__(
        self,
        store: StateStore,
        *,
        events: JobEvents,
        notifier: TaskNotifier,
        on_job_change: Callable[[str], None],
        on_device_revoked: Callable[[str], None],
        max_model_bytes: int,
        workflows: WorkflowCatalog,
        outlines: ModelOutlines | None = None,
        component_types: tuple[str, ...] = (),
    ) -> None:
        self._store = store
        #: Type names the devices' apps register, accepted in job_data besides built-ins and import paths.
        self._component_types = component_types
        self._workflows = workflows
        self._outlines = outlines or ModelOutlines(store.blobs)
        self._events = events
        self._notifier = notifier
        self._on_job_change = on_job_change
        self._on_device_revoked = on_device_revoked
        self._max_model_bytes = max_model_bytes

    # ---- jobs ----
    async def submit_job(self, submission: JobSubmission, *, request_id: str) -> JobView:
        """Creates a PENDING job; the same ``request_id`` returns the job created the first time."""
        if request_id:
            kept = await self._store.recall_reply(_SUBMIT_SCOPE, request_id)
            if kept is not None:
                return await self.describe_job(kept.decode())
        name = submission.name.strip()
        if not name or len(name) > _MAX_NAME:
            raise InvalidArgument(f"a job name needs 1 to {_MAX_NAME} characters")
        check_job_data(submission.job_data)
        model_bytes = await self._check_initial_model(submission.initial_model_sha256)
        said = submission.initial_model_size_bytes
        if said and said != model_bytes:
            raise InvalidArgument(
                f"initial_model.size_bytes is {said}, but the stored model {submission.initial_model_sha256} "
                f"has {model_bytes} bytes"
            )
        workflow = self._workflows.check(submission.workflow, model_bytes=model_bytes)
        if submission.job_data and submission.job_data.strip() != "{}":
            # Empty job_data leaves the runner configuration to the devices' apps (or other clients).
            check_components(
                submission.job_data,
                task_names=self._workflows.task_names(workflow),
                known_types=self._component_types,
                workflow=f"the {workflow.name} workflow",
                known_types_hint="or a name the devices' apps register, listed in the coordinator's "
                "component_types setting",
            )
        job = await self._store.create_job(
            NewJob(
                name=name,
                spec_json=workflow.to_json(),
                job_data=submission.job_data or "{}",
                initial_model_sha256=submission.initial_model_sha256,
                initial_model_size_bytes=model_bytes,
                device_selector=dict(submission.device_selector),
            )
        )
        if request_id:
            first = (
                await self._store.remember_reply(_SUBMIT_SCOPE, request_id, job.job_id.encode())
            ).decode()
            if first != job.job_id:  # a concurrent retry won: keep its job, drop ours
                await self._store.set_job_state(job.job_id, JobState.ABORTED, "duplicate submission")
                await self._store.delete_job(job.job_id)
                return await self.describe_job(first)
        self._on_job_change(job.job_id)
        return JobView(job=job, current_round=0, completed_rounds=0, metrics={})

    async def _check_initial_model(self, sha256: str) -> int:
        """Checks the initial model; returns its size in bytes."""
        if not sha256:
            raise InvalidArgument("the job needs an initial model: upload it with UploadModel first")
        check_sha256(sha256)
        try:
            blob = await self._store.blobs.stat(sha256)
        except NotFound:
            raise NotFound(f"initial model {sha256} was not uploaded") from None
        if blob.size_bytes > self._max_model_bytes:
            raise InvalidArgument(f"the initial model is larger than {self._max_model_bytes} bytes")
        # Outlined, not loaded: a 1 GiB model is checked with a few KiB of memory (tensor data skipped).
        model = await self._outlines.outline(sha256)
        if model.kind is not DataKind.WEIGHTS or not model.tensors:
            raise InvalidArgument("the initial model must be a WEIGHTS DXO with at least one variable")
        # Updates are checked against the model: its decoded size bounds what a device can make the
        # coordinator decode (a sparse tensor of a few bytes can declare any shape).
        decoded = model.decoded_nbytes()
        if decoded > self._max_model_bytes:
            raise InvalidArgument(
                f"the initial model decodes to {decoded} bytes, "
                f"more than the limit of {self._max_model_bytes}"
            )
        return blob.size_bytes

    async def describe_job(self, job_id: str) -> JobView:
        """Returns a job with its round in progress, the rounds it completed and its latest metrics."""
        job = await self._store.get_job(job_id)
        run = await self._current_run(job_id)
        completed = 0 if run is None else run.round
        metrics = {} if run is None else _numeric(json.loads(run.metrics_json or "{}"))
        try:
            steps = self._workflows.num_steps(job.workflow)
        except ValueError:  # a spec_json this release cannot read: say nothing of its steps
            steps = 0
        return JobView(
            job=job,
            current_round=current_round(job, completed, steps),
            completed_rounds=completed,
            metrics=metrics,
        )

    async def _current_run(self, job_id: str) -> Run | None:
        try:
            return await self._store.get_current_run(job_id)
        except NotFound:
            return None

    async def list_jobs(self, *, page_size: int, page_token: str, state: JobState | None) -> Page[Job]:
        """Lists jobs, newest first."""
        return await self._store.list_jobs(page_size=page_size or 50, page_token=page_token, state=state)

    async def abort_job(self, job_id: str, reason: str) -> JobView:
        """Aborts a pending or running job; an already aborted job is returned as it is."""
        job = await self._store.get_job(job_id)
        if job.state is JobState.ABORTED:
            return await self.describe_job(job_id)
        if is_final(job.state):
            raise FailedPrecondition(f"job {job_id} is {job.state.value}; only pending or running jobs abort")
        message = reason or "aborted by an operator"
        await self._events.set_state(job_id, JobState.ABORTED, message)
        await self._store.cancel_job_tasks(job_id)
        run = await self._current_run(job_id)
        if run is not None and run.state is RunState.RUNNING:
            # Ended meanwhile, perhaps, by a coordinator that found its job final (JobSupervisor).
            with contextlib.suppress(IllegalTransition):
                await self._store.finish_run(run.run_id, RunState.ABORTED, message)
        self._on_job_change(job_id)
        self._notifier.notify(job_id)  # long-polling devices learn at once that the job is over
        return await self.describe_job(job_id)

    async def delete_job(self, job_id: str) -> int:
        """Deletes a final job and everything it owns; returns the blob bytes freed."""
        job = await self._store.get_job(job_id)
        if not is_final(job.state):
            raise FailedPrecondition(f"job {job_id} is {job.state.value}: abort it before deleting it")
        return await self._store.delete_job(job_id)

    def watch_job(self, job_id: str, *, after_sequence: int) -> AsyncIterator[JobEvent]:
        """Streams the job's events after ``after_sequence`` until it is final."""
        return self._events.watch(job_id, after_sequence=after_sequence)

    # ---- devices ----
    async def list_devices(
        self, *, page_size: int, page_token: str, state: DeviceState | None
    ) -> Page[Device]:
        """Lists enrolled devices."""
        return await self._store.list_devices(page_size=page_size or 50, page_token=page_token, state=state)

    async def approve_device(self, device_id: str) -> Device:
        """Approves a device awaiting approval (it may take part from now on); an approved one is
        returned as it is, a revoked one is an IllegalTransition."""
        return await self._store.approve_device(device_id)

    async def revoke_device(self, device_id: str) -> Device:
        """Revokes a device's credential for good."""
        device = await self._store.revoke_device(device_id)
        self._on_device_revoked(device_id)
        return device

    # ---- models ----
    async def model_location(self, job_id: str, round: int) -> ModelLocation:
        """Finds a job's model: a kept round's checkpoint, or with ``round`` 0 the latest one."""
        job = await self._store.get_job(job_id)
        run = await self._current_run(job_id)
        if round == 0:
            if run is not None and run.global_model_sha256:
                return ModelLocation(sha256=run.global_model_sha256, round=run.round)
            if job.initial_model_sha256:
                return ModelLocation(sha256=job.initial_model_sha256, round=0)
            raise NotFound(f"job {job_id} has no model")
        if run is not None:
            for checkpoint in await self._store.list_checkpoints(run.run_id):
                if checkpoint.round == round:
                    return ModelLocation(sha256=checkpoint.model_sha256, round=round)
        raise NotFound(f"job {job_id} keeps no model of round {round}")


def _numeric(values: object) -> dict[str, float]:
    if not isinstance(values, dict):
        return {}
    return {
        str(k): float(v) for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
