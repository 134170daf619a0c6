"""The domain state machines allow exactly the agreed edges (exhaustive over every pair of states)."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from typing import Any

import pytest

from fedlink.common.errors import FailedPrecondition, IllegalTransition
from fedlink.server.domain import (
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

J, A, D, R, T = JobState, AssignmentState, DeviceState, RunState, TaskState

# The agreed edges, written out independently of the tables in the code under test.
LEGAL: dict[type[enum.StrEnum], set[tuple[Any, Any]]] = {
    JobState: {
        (J.PENDING, J.RUNNING),
        (J.PENDING, J.ABORTED),
        (J.PENDING, J.FAILED),
        (J.RUNNING, J.FINISHED),
        (J.RUNNING, J.FAILED),
        (J.RUNNING, J.ABORTED),
    },
    AssignmentState: {
        (A.LEASED, A.COMPLETED),
        (A.LEASED, A.FAILED),
        (A.LEASED, A.EXPIRED),
        (A.LEASED, A.RELEASED),
    },
    DeviceState: {
        (D.ONLINE, D.OFFLINE),
        (D.OFFLINE, D.ONLINE),
        (D.ONLINE, D.REVOKED),
        (D.OFFLINE, D.REVOKED),
        (D.PENDING, D.ONLINE),  # approved
        (D.PENDING, D.REVOKED),  # refused
    },
    RunState: {(R.RUNNING, R.FINISHED), (R.RUNNING, R.FAILED), (R.RUNNING, R.ABORTED)},
    TaskState: {(T.OPEN, T.CLOSED), (T.OPEN, T.CANCELLED)},
}
TRANSITION: dict[type[enum.StrEnum], Callable[[Any, Any], Any]] = {
    JobState: transition_job,
    AssignmentState: transition_assignment,
    DeviceState: transition_device,
    RunState: transition_run,
    TaskState: transition_task,
}
CASES = [
    pytest.param(machine, current, target, id=f"{machine.__name__}:{current}->{target}")
    for machine in LEGAL
    for current, target in itertools.product(list(machine), repeat=2)
]


@pytest.mark.parametrize(("machine", "current", "target"), CASES)
def test_transition_allows_exactly_the_agreed_edges(
    machine: type[enum.StrEnum], current: Any, target: Any
) -> None:
    transition = TRANSITION[machine]
    if (current, target) in LEGAL[machine]:
        assert transition(current, target) is target
    else:
        with pytest.raises(IllegalTransition) as caught:
            transition(current, target)
        assert isinstance(caught.value, FailedPrecondition)
        assert caught.value.current == current.value
        assert caught.value.target == target.value
        assert str(current.value) in caught.value.message


@pytest.mark.parametrize("machine", list(LEGAL), ids=lambda m: m.__name__)
def test_final_states_are_those_without_outgoing_edges(machine: type[enum.StrEnum]) -> None:
    sources = {current for current, _ in LEGAL[machine]}
    for state in machine:
        assert is_final(state) is (state not in sources), state  # type: ignore[arg-type]


def test_state_values_match_the_wire_enum_names() -> None:
    from fedlink.v1 import states_pb2

    machine: type[enum.StrEnum]
    for machine, prefix, wire in [
        (JobState, "JOB_STATE_", states_pb2.JobState),
        (AssignmentState, "ASSIGNMENT_STATE_", states_pb2.AssignmentState),
        (DeviceState, "DEVICE_STATE_", states_pb2.DeviceState),
        (ResultStatus, "RESULT_STATUS_", states_pb2.ResultStatus),
    ]:
        names = {name.removeprefix(prefix) for name in wire.DESCRIPTOR.values_by_name} - {"UNSPECIFIED"}
        assert names == {state.value for state in machine}
