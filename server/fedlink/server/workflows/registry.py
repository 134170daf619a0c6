"""The one place workflows are named, checked, described and built.

Every built-in workflow is a :class:`WorkflowType` in :data:`BUILTIN`: its name (the job file's section,
the stored spec's ``workflow``), a one-line summary, its parameters class and how to build its driver.
A job may also name a workflow of the operator's own by import path (``pkg.module:factory``, see
:mod:`fedlink.server.workflows.custom`), which the coordinator runs only if its ``allow_workflows``
setting matches the module.

The supervisor builds a job's driver here (:meth:`Workflows.build`), the control protocol checks a
submission here (:meth:`Workflows.check`), and the job file, the CLI, the simulation and the wire
mapping read and describe parameters here (:func:`parse`, :func:`spec_of`, :func:`describe`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from fedlink.common.errors import InvalidArgument
from fedlink.server.domain import WorkflowSpec
from fedlink.server.workflows.base import Workflow
from fedlink.server.workflows.custom import check_allowed, load_factory
from fedlink.server.workflows.fedavg import FedAvg, FedAvgParams
from fedlink.server.workflows.fedbuff import FedBuff, FedBuffParams
from fedlink.server.workflows.params import WorkflowParams
from fedlink.server.workflows.robust import FedMedianParams, FedTrimmedAvgParams, KrumParams
from fedlink.server.workflows.strategies import FedAdagradParams, FedAdamParams, FedAvgMParams, FedYogiParams

P = TypeVar("P", bound=WorkflowParams)


@dataclass(frozen=True, slots=True, kw_only=True)
class DriverOptions:
    """How a coordinator tunes the drivers it runs (its own choice, not the job's)."""

    #: Longest wait between two looks at a run's state while nothing signals progress.
    poll_seconds: float = 1.0
    #: Least time between two reads of a round's state (None: the workflow's default).
    round_check_seconds: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowLimits:
    """What an operator allows the workflows of submitted jobs (from the coordinator's settings)."""

    #: Module patterns (``fnmatch``, e.g. ``"mypkg.*"``) whose workflows a job may name by import path.
    allow_workflows: tuple[str, ...] = ()
    #: Most bytes of updates a round may hold in memory (robust aggregation cannot stream).
    max_buffered_round_bytes: int = 2 * 1024**3
    #: Values the coordinator sets where a submission leaves a parameter out (e.g. keep_checkpoints).
    defaults: Mapping[str, Any] = ()  # type: ignore[assignment]  # an empty mapping, frozen

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", dict(self.defaults or {}))


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkflowType(Generic[P]):
    """One built-in workflow."""

    #: Its name: the job file's section and the stored spec's ``workflow``.
    name: str
    #: What it does, in a line (``fedlink job show``, the docs).
    summary: str
    #: Its parameters.
    params: type[P]
    #: Builds the driver of one run.
    build: Callable[[P, DriverOptions], Workflow]


def _rounds(params: FedAvgParams, options: DriverOptions) -> Workflow:
    """The driver of every round-based workflow: its parameters pick the round rule and server step."""
    return FedAvg(params, poll_seconds=options.poll_seconds, min_check_seconds=options.round_check_seconds)


def _buffered(params: FedBuffParams, options: DriverOptions) -> Workflow:
    """The FedBuff driver: no rounds, model versions from buffered asynchronous updates."""
    return FedBuff(params, poll_seconds=options.poll_seconds, min_check_seconds=options.round_check_seconds)


_TYPES: tuple[WorkflowType[Any], ...] = (
    WorkflowType(
        name="fedavg",
        summary="synchronous rounds of sampled devices, weighted averaging (McMahan et al. 2017)",
        params=FedAvgParams,
        build=_rounds,
    ),
    WorkflowType(
        name="fedavgm",
        summary="FedAvg with server momentum (Hsu et al. 2019)",
        params=FedAvgMParams,
        build=_rounds,
    ),
    WorkflowType(
        name="fedadam",
        summary="FedAvg rounds, Adam server optimizer (Reddi et al. 2021)",
        params=FedAdamParams,
        build=_rounds,
    ),
    WorkflowType(
        name="fedyogi",
        summary="FedAvg rounds, Yogi server optimizer (Reddi et al. 2021)",
        params=FedYogiParams,
        build=_rounds,
    ),
    WorkflowType(
        name="fedadagrad",
        summary="FedAvg rounds, Adagrad server optimizer (Reddi et al. 2021)",
        params=FedAdagradParams,
        build=_rounds,
    ),
    WorkflowType(
        name="fedmedian",
        summary="rounds aggregated by the coordinate-wise median (Yin et al. 2018)",
        params=FedMedianParams,
        build=_rounds,
    ),
    WorkflowType(
        name="fedtrimmedavg",
        summary="rounds aggregated by the coordinate-wise trimmed mean (Yin et al. 2018)",
        params=FedTrimmedAvgParams,
        build=_rounds,
    ),
    WorkflowType(
        name="krum",
        summary="rounds aggregated by Krum or Multi-Krum (Blanchard et al. 2017)",
        params=KrumParams,
        build=_rounds,
    ),
    WorkflowType(
        name="fedbuff",
        summary="asynchronous buffered aggregation of model versions (FedBuff, Nguyen et al. 2022)",
        params=FedBuffParams,
        build=_buffered,
    ),
)

#: The built-in workflows by name.
BUILTIN: Mapping[str, WorkflowType[Any]] = {t.name: t for t in _TYPES}


def builtin(name: str) -> WorkflowType[Any]:
    """The built-in workflow called ``name``.

    Raises:
        InvalidArgument: no such workflow (the message lists the known ones).
    """
    found = BUILTIN.get(name)
    if found is None:
        raise InvalidArgument(
            f"unknown workflow {name!r}; built-in: {', '.join(BUILTIN)}, or an import path pkg.module:factory"
        )
    return found


def parse(spec: WorkflowSpec) -> WorkflowParams:
    """The parameters of a built-in workflow's spec, checked.

    Raises:
        InvalidArgument: an unknown workflow, or a bad parameter (naming it).
    """
    params: WorkflowParams = builtin(spec.name).params.from_config(spec.config, section=spec.name)
    return params


def spec_of(params: WorkflowParams) -> WorkflowSpec:
    """The spec of built-in parameters (every field written out)."""
    for workflow_type in BUILTIN.values():
        if type(params) is workflow_type.params:
            return WorkflowSpec(name=workflow_type.name, config=params.to_config())
    raise InvalidArgument(f"{type(params).__name__} are not the parameters of a built-in workflow")


def describe(spec: WorkflowSpec) -> dict[str, Any]:
    """A spec's parameters for people: a built-in's every field, or a custom workflow's config as is."""
    if spec.is_import_path:
        return dict(spec.config)
    try:
        return parse(spec).to_config()
    except InvalidArgument:
        return dict(spec.config)  # described as stored, even if this release reads it differently


def num_steps(spec: WorkflowSpec) -> int:
    """How many rounds (or model versions) a job runs to; 0 when its workflow does not say."""
    if spec.is_import_path:
        value = spec.config.get("num_rounds", 0)
        return value if isinstance(value, int) and not isinstance(value, bool) else 0
    try:
        return parse(spec).num_steps
    except InvalidArgument:
        return 0


def task_names(spec: WorkflowSpec) -> tuple[str, ...] | None:
    """The tasks a job of this spec sends (each needs an executor in its job_data); None when the
    workflow does not say (one of the operator's own) or the spec does not parse."""
    if spec.is_import_path:
        return None
    try:
        return parse(spec).task_names
    except InvalidArgument:
        return None


class Workflows:
    """The coordinator's workflows: checks submissions and builds the drivers of runs."""

    def __init__(self, limits: WorkflowLimits | None = None, options: DriverOptions | None = None) -> None:
        self._limits = limits or WorkflowLimits()
        self._options = options or DriverOptions()

    def check(self, spec: WorkflowSpec, *, model_bytes: int) -> WorkflowSpec:
        """Checks a submitted spec against a model of ``model_bytes``; returns the spec to store (a
        built-in's every parameter written out, the coordinator's defaults where the submission left
        one out).

        Raises:
            InvalidArgument: an unknown workflow, a bad parameter, a round that would hold more
                updates than ``max_buffered_round_bytes``, or a custom workflow refusing its config.
            FailedPrecondition: an import-path workflow the ``allow_workflows`` setting does not allow.
        """
        if spec.is_import_path:
            check_allowed(spec.name, self._limits.allow_workflows)
            load_factory(spec.name).check(spec.config)
            return spec
        workflow_type = builtin(spec.name)
        config = dict(spec.config)
        for key, value in self._limits.defaults.items():
            if key not in config and key in workflow_type.params.field_names():
                config[key] = value
        params = workflow_type.params.from_config(config, section=spec.name)
        params.check_memory(
            model_bytes=model_bytes, max_buffered_round_bytes=self._limits.max_buffered_round_bytes
        )
        return WorkflowSpec(name=spec.name, config=params.to_config())

    def num_steps(self, spec: WorkflowSpec) -> int:
        """How many rounds (or model versions) a job of this spec runs to; 0 if it does not say."""
        return num_steps(spec)

    def task_names(self, spec: WorkflowSpec) -> tuple[str, ...] | None:
        """The tasks a job of this spec sends; None if the workflow does not say."""
        return task_names(spec)

    def build(self, spec: WorkflowSpec) -> Workflow:
        """The driver of one run of a job with this spec.

        Raises:
            InvalidArgument: the spec does not name a workflow this coordinator knows.
            FailedPrecondition: an import-path workflow that is no longer allowed.
        """
        if spec.is_import_path:
            check_allowed(spec.name, self._limits.allow_workflows)
            return load_factory(spec.name).build(spec.config)
        workflow_type = builtin(spec.name)
        return workflow_type.build(parse(spec), self._options)


__all__ = [
    "BUILTIN",
    "DriverOptions",
    "WorkflowLimits",
    "WorkflowType",
    "Workflows",
    "builtin",
    "describe",
    "num_steps",
    "parse",
    "spec_of",
    "task_names",
]
