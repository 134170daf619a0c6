"""Domain-specific error types, all inside fedlink's one error hierarchy."""

from __future__ import annotations

from fedlink.common.errors import FailedPrecondition


class LeaseLost(FailedPrecondition):
    """The device no longer holds the assignment: its lease expired, or it was completed or released."""

    def __init__(self, assignment_id: str, reason: str) -> None:
        super().__init__(f"assignment {assignment_id} is no longer leased to this device: {reason}")
        self.assignment_id = assignment_id
        self.reason = reason


class RunLeaseHeld(FailedPrecondition):
    """Another coordinator holds the lease that lets it drive this run."""

    def __init__(self, run_id: str, owner: str) -> None:
        super().__init__(f"run {run_id} is driven by coordinator {owner!r}; its lease has not expired")
        self.run_id = run_id
        self.owner = owner
