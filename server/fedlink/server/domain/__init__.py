"""The pure domain: state machines, the values the store returns, the clock. Imports nothing of ours
but :mod:`fedlink.common.errors`."""

from fedlink.server.domain.clock import Clock, ManualClock, SystemClock
from fedlink.server.domain.errors import LeaseLost, RunLeaseHeld
from fedlink.server.domain.ids import new_id
from fedlink.server.domain.models import (
    Assignment,
    Blob,
    Checkpoint,
    Device,
    Job,
    JobEvent,
    ReportOutcome,
    Result,
    Run,
    Task,
)
from fedlink.server.domain.states import (
    ACTIVE_ASSIGNMENT_STATES,
    AssignmentState,
    DeviceState,
    JobState,
    ResultStatus,
    RunState,
    TaskState,
    is_final,
    transition_assignment,
    transition_device,
    transition_job,
    transition_run,
    transition_task,
)

__all__ = [
    "ACTIVE_ASSIGNMENT_STATES",
    "Assignment",
    "AssignmentState",
    "Blob",
    "Checkpoint",
    "Clock",
    "Device",
    "DeviceState",
    "Job",
    "JobEvent",
    "JobState",
    "LeaseLost",
    "ManualClock",
    "ReportOutcome",
    "Result",
    "ResultStatus",
    "Run",
    "RunLeaseHeld",
    "RunState",
    "SystemClock",
    "Task",
    "TaskState",
    "is_final",
    "new_id",
    "transition_assignment",
    "transition_device",
    "transition_job",
    "transition_run",
    "transition_task",
]
