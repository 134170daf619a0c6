"""The values the state store hands out: frozen snapshots of devices, jobs, runs, tasks and results.

Times are timezone-aware UTC datetimes. Ids are UUIDv7 hex strings (see ``ids``). JSON fields (``spec_json``,
``job_data``, ``metrics_json``, ``payload_json``) are opaque strings owned by the layer that writes them.
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from fedlink.server.domain.states import (
    AssignmentState,
    DeviceState,
    JobState,
    ResultStatus,
    RunState,
    TaskState,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Device:
    """An enrolled edge participant."""

    device_id: str
    #: Platform, app version, capabilities... as reported at enrollment; device selectors match on it.
    device_info: Mapping[str, str]
    user_info: Mapping[str, str]
    state: DeviceState
    enrolled_at: datetime
    last_seen: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowSpec:
    """Which workflow drives a job, and its configuration, as a JSON document.

    ``name`` is a built-in workflow's name (``"fedavg"``, ``"fedadam"``, ...) or, for a workflow of the
    operator's own, its import path (``"pkg.module:factory"``). ``config`` is the workflow's parameters
    as JSON values; the workflows layer checks them.
    """

    name: str
    config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def is_import_path(self) -> bool:
        """True if ``name`` is an import path (``pkg.module:factory``) rather than a built-in's name."""
        return ":" in self.name

    def to_json(self) -> str:
        """The document stored as a job's ``spec_json``."""
        return json.dumps({"workflow": self.name, "config": dict(self.config)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WorkflowSpec:
        """Reads :meth:`to_json`'s document, or the first releases' ``{"workflow": "fedavg", "fedavg":
        {...}}``; ``ValueError`` if it is neither."""
        document = json.loads(text)
        if not isinstance(document, dict) or not isinstance(document.get("workflow"), str):
            raise ValueError("a workflow spec is a JSON object with a 'workflow' name")
        name = document["workflow"]
        config = document.get("config", document.get(name, {}))
        if not isinstance(config, dict):
            raise ValueError(f"the config of workflow {name!r} is not a JSON object")
        return cls(name=name, config=config)


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """What an operator submitted."""

    job_id: str
    name: str
    state: JobState
    #: The workflow and its parameters: a :class:`WorkflowSpec` as JSON (see :attr:`workflow`).
    spec_json: str
    #: The runner config (NVFlare edge format), handed to devices as is.
    job_data: str
    #: The initial model blob, if the job has one.
    initial_model_sha256: str | None
    #: Its size in bytes (None for jobs stored before sizes were kept, whose blob is gone).
    initial_model_size_bytes: int | None = None
    #: Which devices may take part: every key must equal the device's ``device_info`` value.
    device_selector: Mapping[str, str]
    #: Why the job is in its state (e.g. the error that failed it); empty if nothing to say.
    message: str
    created_at: datetime
    updated_at: datetime

    @property
    def workflow(self) -> WorkflowSpec:
        """The job's workflow spec (``ValueError`` if ``spec_json`` is not one)."""
        return WorkflowSpec.from_json(self.spec_json)


def selector_matches(selector: Mapping[str, str], device_info: Mapping[str, str]) -> bool:
    """True if ``device_info`` has every key/value pair of a job's device ``selector``."""
    return all(device_info.get(k) == v for k, v in selector.items())


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """One execution of a job by a coordinator; a restarted coordinator resumes the current run."""

    run_id: str
    job_id: str
    state: RunState
    #: The coordinator that drives the run, and until when its lease holds (room for replicas).
    owner: str | None
    owner_lease_expires_at: datetime | None
    #: The last checkpointed round (or model version for asynchronous workflows); 0 before the first.
    round: int
    global_model_sha256: str | None
    #: The metrics history, as JSON owned by the workflow.
    metrics_json: str
    message: str
    created_at: datetime
    updated_at: datetime
    #: The workflow's own state at the last checkpoint (counters, as JSON owned by the workflow).
    workflow_state_json: str = "{}"
    #: The blob of the workflow state's arrays (a WEIGHTS-like DXO, e.g. optimizer moments), if any.
    workflow_state_sha256: str | None = None
    #: The fencing counter: one more each time a different owner takes the lease (1 for the first).
    lease_epoch: int = 0

    @property
    def fence(self) -> RunFence:
        """The token this snapshot's owner fences its writes with (see :class:`RunFence`)."""
        return RunFence(run_id=self.run_id, owner=self.owner or "", epoch=self.lease_epoch)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFence:
    """Who drives a run, as of the lease they took: a write made with it is refused (RunLeaseLost)
    once another owner has taken the lease since, even if this one never noticed it lost it."""

    run_id: str
    owner: str
    #: The run's ``lease_epoch`` when ``owner`` took the lease.
    epoch: int


#: The task name of training: a device answers with a WEIGHTS or WEIGHT_DIFF update of the task's model.
TRAIN_TASK = "train"
#: The task name of evaluation: a device answers with METRICS of the task's model on its data.
EVALUATE_TASK = "evaluate"


@dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """One unit of work a workflow hands out."""

    task_id: str
    job_id: str
    run_id: str
    round: int
    #: The task name devices dispatch on (``train``, ``evaluate``...).
    name: str
    #: The task's DXO payload, stored as a blob.
    payload_sha256: str | None
    deadline: datetime
    #: How many devices may hold the task at once (LEASED or COMPLETED): the results it needs.
    slots: int
    #: True if only the devices in the task's target list may claim it.
    targeted: bool
    state: TaskState
    created_at: datetime
    #: The version of the model the task carries (0: the job's initial model); None if it says none.
    model_version: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    """A task held by a device under a lease."""

    assignment_id: str
    task_id: str
    job_id: str
    device_id: str
    #: Which of the task's slots this assignment occupies (0 <= slot < task.slots).
    slot: int
    state: AssignmentState
    lease_expires_at: datetime
    created_at: datetime


#: The longest failure reason kept, in characters: a device's exception and its message, not a log.
MAX_FAILURE_REASON = 1000


def failure_reason(message: str) -> str:
    """A device's failure message as it is stored and shown to operators: every control character
    (newlines, escapes) a space, runs of whitespace one space, at most :data:`MAX_FAILURE_REASON`
    characters (a longer one is cut and ends with an ellipsis)."""
    printable = "".join(c if c.isprintable() else " " for c in message)
    reason = " ".join(printable.split())
    if len(reason) > MAX_FAILURE_REASON:
        reason = reason[: MAX_FAILURE_REASON - 1].rstrip() + "…"
    return reason


def summarize_failures(reasons: Sequence[str], *, most: int = 3) -> str:
    """One line: how many devices failed, and the ``most`` most common reasons with their counts
    (ties in the order first seen), e.g. ``2 failed: "ValueError: bad shape" (2)``; "" if none."""
    if not reasons:
        return ""
    counts = Counter(r or "no reason given" for r in reasons)
    common = ", ".join(f'"{reason}" ({count})' for reason, count in counts.most_common(most))
    others = len(counts) - min(most, len(counts))
    return f"{len(reasons)} failed: {common}" + (f" and {others} other reasons" if others else "")


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """What a device reported for an assignment."""

    result_id: str
    assignment_id: str
    task_id: str
    device_id: str
    status: ResultStatus
    #: The result payload blob; None for failures and for stale results (their payload is dropped).
    payload_sha256: str | None
    #: A digest of the whole report as received, so a retried report is recognised as the same one.
    report_digest: str
    error_message: str
    #: True if the result counts for aggregation (on time and succeeded).
    accepted: bool
    #: True if the report came after the round closed, the lease ended or the job stopped.
    stale: bool
    request_id: str
    created_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class Blob:
    """A content-addressed byte string."""

    sha256: str
    size_bytes: int
    created_at: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """A run's state after one round: the global model and the metrics."""

    run_id: str
    round: int
    model_sha256: str
    metrics_json: str
    created_at: datetime
    #: The workflow's own state after the round, as on the run (see :class:`Run`).
    workflow_state_json: str = "{}"
    workflow_state_sha256: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class JobEvent:
    """One progress event of a job, as ``fedlink job watch`` shows it."""

    job_id: str
    #: Increases with every event of the job in commit order (gaps are possible).
    sequence: int
    time: datetime
    kind: str
    payload_json: str


def job_event_json(round: int, payload: Mapping[str, Any]) -> str:
    """The stored payload of an event of ``round`` (``{"round": ..., **payload}``)."""
    return json.dumps({"round": round, **payload}, sort_keys=True)


class ReportOutcome(enum.StrEnum):
    """What became of a reported result."""

    #: Stored; counts for aggregation if it succeeded (a failure frees the slot).
    ACCEPTED = "ACCEPTED"
    #: Stored as metadata only; not aggregated (round closed, lease expired or job stopped).
    STALE = "STALE"
