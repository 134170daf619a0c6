"""Domain-specific error types, all inside fedlink's one error hierarchy."""

from __future__ import annotations

from datetime import datetime

from fedlink.common.errors import FailedPrecondition


class LeaseLost(FailedPrecondition):
    """The device no longer holds the assignment: its lease expired, or it was completed or released."""

    def __init__(self, assignment_id: str, reason: str) -> None:
        super().__init__(f"assignment {assignment_id} is no longer leased to this device: {reason}")
        self.assignment_id = assignment_id
        self.reason = reason


class RunLeaseHeld(FailedPrecondition):
    """Another coordinator holds the lease that lets it drive this run."""

    def __init__(self, run_id: str, owner: str, expires_at: datetime | None = None) -> None:
        super().__init__(f"run {run_id} is driven by coordinator {owner!r}; its lease has not expired")
        self.run_id = run_id
        self.owner = owner
        #: When the lease runs out unless renewed: the earliest moment another coordinator may take it.
        self.expires_at = expires_at


class RunEnded(FailedPrecondition):
    """The run has ended: nobody drives it any more (its job is final, or is being made final)."""

    def __init__(self, run_id: str, state: str) -> None:
        super().__init__(f"run {run_id} has ended ({state}); nobody drives it any more")
        self.run_id = run_id
        self.state = state


class RunLeaseLost(FailedPrecondition):
    """A write fenced by a run's lease came from an owner that no longer holds it: another coordinator
    took the run over (or it ended) while this one was paused. The write changed nothing."""

    def __init__(self, run_id: str, owner: str, epoch: int, reason: str) -> None:
        super().__init__(
            f"run {run_id} is no longer driven by coordinator {owner!r} (lease epoch {epoch}): {reason}"
        )
        self.run_id = run_id
        self.owner = owner
        self.epoch = epoch
        self.reason = reason
