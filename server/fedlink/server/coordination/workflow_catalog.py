"""What the control protocol needs to know of workflows, without importing them.

The workflows layer implements it (:class:`fedlink.server.workflows.registry.Workflows`); the coordinator
hands it to the control protocol, which checks every submitted job's workflow spec through it.
"""

from __future__ import annotations

from typing import Protocol

from fedlink.server.domain import WorkflowSpec


class WorkflowCatalog(Protocol):
    """Checks and describes workflow specs."""

    def check(self, spec: WorkflowSpec, *, model_bytes: int) -> WorkflowSpec:
        """Checks a submitted spec for a model of ``model_bytes``; returns the spec to store.

        Raises:
            InvalidArgument: an unknown workflow or a bad parameter.
            FailedPrecondition: a workflow the coordinator's settings do not allow.
        """
        ...

    def num_steps(self, spec: WorkflowSpec) -> int:
        """How many rounds (or model versions) a job of this spec runs to; 0 if it does not say."""
        ...

    def task_names(self, spec: WorkflowSpec) -> tuple[str, ...] | None:
        """The tasks a job of this spec sends (each needs an executor); None if it does not say."""
        ...
