"""The lifecycle states of fedlink's entities and the only edges each state machine allows."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

from fedlink.common.errors import IllegalTransition


class JobState(enum.StrEnum):
    """The state of a job: PENDING -> RUNNING -> FINISHED | FAILED | ABORTED."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    ABORTED = "ABORTED"


class RunState(enum.StrEnum):
    """The state of one execution of a job: RUNNING -> FINISHED | FAILED | ABORTED."""

    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    ABORTED = "ABORTED"


class TaskState(enum.StrEnum):
    """The state of a task: OPEN (devices may claim it) -> CLOSED | CANCELLED."""

    OPEN = "OPEN"
    CLOSED = "CLOSED"
    CANCELLED = "CANCELLED"


class AssignmentState(enum.StrEnum):
    """The state of a task held by a device: LEASED -> COMPLETED | FAILED | EXPIRED | RELEASED."""

    LEASED = "LEASED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    EXPIRED = "EXPIRED"
    RELEASED = "RELEASED"


class DeviceState(enum.StrEnum):
    """The state of an enrolled device: ONLINE <-> OFFLINE, either -> REVOKED (final).

    A coordinator that requires approval enrols devices PENDING; an operator's approval makes them
    ONLINE (or a revocation REVOKED).
    """

    ONLINE = "ONLINE"
    OFFLINE = "OFFLINE"
    REVOKED = "REVOKED"
    PENDING = "PENDING"


class ResultStatus(enum.StrEnum):
    """How a device's work on a task ended."""

    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


JOB_TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.ABORTED, JobState.FAILED}),
    JobState.RUNNING: frozenset({JobState.FINISHED, JobState.FAILED, JobState.ABORTED}),
    JobState.FINISHED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.ABORTED: frozenset(),
}

RUN_TRANSITIONS: Mapping[RunState, frozenset[RunState]] = {
    RunState.RUNNING: frozenset({RunState.FINISHED, RunState.FAILED, RunState.ABORTED}),
    RunState.FINISHED: frozenset(),
    RunState.FAILED: frozenset(),
    RunState.ABORTED: frozenset(),
}

TASK_TRANSITIONS: Mapping[TaskState, frozenset[TaskState]] = {
    TaskState.OPEN: frozenset({TaskState.CLOSED, TaskState.CANCELLED}),
    TaskState.CLOSED: frozenset(),
    TaskState.CANCELLED: frozenset(),
}

ASSIGNMENT_TRANSITIONS: Mapping[AssignmentState, frozenset[AssignmentState]] = {
    AssignmentState.LEASED: frozenset(
        {
            AssignmentState.COMPLETED,
            AssignmentState.FAILED,
            AssignmentState.EXPIRED,
            AssignmentState.RELEASED,
        }
    ),
    AssignmentState.COMPLETED: frozenset(),
    AssignmentState.FAILED: frozenset(),
    AssignmentState.EXPIRED: frozenset(),
    AssignmentState.RELEASED: frozenset(),
}

DEVICE_TRANSITIONS: Mapping[DeviceState, frozenset[DeviceState]] = {
    DeviceState.ONLINE: frozenset({DeviceState.OFFLINE, DeviceState.REVOKED}),
    DeviceState.OFFLINE: frozenset({DeviceState.ONLINE, DeviceState.REVOKED}),
    DeviceState.REVOKED: frozenset(),
    DeviceState.PENDING: frozenset({DeviceState.ONLINE, DeviceState.REVOKED}),
}

# Assignment states that hold one of the task's slots: a FAILED, EXPIRED or RELEASED assignment frees it.
ACTIVE_ASSIGNMENT_STATES: frozenset[AssignmentState] = frozenset(
    {AssignmentState.LEASED, AssignmentState.COMPLETED}
)

_S = TypeVar("_S", bound=enum.StrEnum)


def _check(entity: str, table: Mapping[_S, frozenset[_S]], current: _S, target: _S) -> _S:
    if target not in table[current]:
        raise IllegalTransition(entity, current.value, target.value)
    return target


def is_final(state: JobState | RunState | TaskState | AssignmentState | DeviceState) -> bool:
    """Tell whether no edge leaves ``state`` in its machine."""
    match state:
        case JobState():
            return not JOB_TRANSITIONS[state]
        case RunState():
            return not RUN_TRANSITIONS[state]
        case TaskState():
            return not TASK_TRANSITIONS[state]
        case AssignmentState():
            return not ASSIGNMENT_TRANSITIONS[state]
        case DeviceState():
            return not DEVICE_TRANSITIONS[state]


def transition_job(current: JobState, target: JobState) -> JobState:
    """Return ``target`` if a job may move there from ``current``.

    Raises:
        IllegalTransition: the job state machine has no such edge.
    """
    return _check("job", JOB_TRANSITIONS, current, target)


def transition_run(current: RunState, target: RunState) -> RunState:
    """Return ``target`` if a run may move there from ``current``.

    Raises:
        IllegalTransition: the run state machine has no such edge.
    """
    return _check("run", RUN_TRANSITIONS, current, target)


def transition_task(current: TaskState, target: TaskState) -> TaskState:
    """Return ``target`` if a task may move there from ``current``.

    Raises:
        IllegalTransition: the task state machine has no such edge.
    """
    return _check("task", TASK_TRANSITIONS, current, target)


def transition_assignment(current: AssignmentState, target: AssignmentState) -> AssignmentState:
    """Return ``target`` if an assignment may move there from ``current``.

    Raises:
        IllegalTransition: the assignment state machine has no such edge.
    """
    return _check("assignment", ASSIGNMENT_TRANSITIONS, current, target)


def transition_device(current: DeviceState, target: DeviceState) -> DeviceState:
    """Return ``target`` if a device may move there from ``current``.

    Raises:
        IllegalTransition: the device state machine has no such edge.
    """
    return _check("device", DEVICE_TRANSITIONS, current, target)
