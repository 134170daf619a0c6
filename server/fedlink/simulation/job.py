"""The job a simulation runs: what ``fedlink job submit`` sends, as a Python value or a job file."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy.typing as npt

from fedlink.common.dxo import DXO, DataKind
from fedlink.common.errors import InvalidArgument
from fedlink.server.domain import WorkflowSpec
from fedlink.server.tracking.sinks import TrackingConfig
from fedlink.server.workflows import registry
from fedlink.server.workflows.params import WorkflowParams

if TYPE_CHECKING:
    from fedlink.server.cli.jobfile import SimulationSection

__all__ = ["SimulationJob"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationJob:
    """A job: the same definition the coordinator accepts (see ``fedlink job submit``)."""

    name: str
    #: The workflow: a built-in's parameters (``FedAvgParams(num_rounds=5)``, ``FedAdamParams(...)``),
    #: or a :class:`~fedlink.server.domain.WorkflowSpec` (a built-in's name or an import path, and its
    #: config). The simulation is the operator's own process: import-path workflows need no allowing.
    workflow: WorkflowParams | WorkflowSpec
    #: The initial global model: named arrays, or a WEIGHTS DXO.
    model: Mapping[str, npt.NDArray[Any]] | DXO = field(repr=False)
    #: The runner configuration (NVFlare edge format) as a mapping or JSON text; empty means none
    #: (then the simulation's ``runner=`` argument must provide the executor).
    job_data: Mapping[str, Any] | str = field(default="", repr=False)
    #: ``device_info`` pairs a device must have to take part (virtual devices have
    #: ``{"simulation": "true"}`` plus whatever ``device_info=`` the simulation is given).
    device_selector: Mapping[str, str] = field(default_factory=dict)
    #: A job file's ``[simulation]`` section: the devices' data and how it is split, and how many
    #: devices (the simulation's ``data=`` and ``num_devices`` come first); None for none.
    simulation: SimulationSection | None = None
    #: A job file's ``[tracking]`` section: the MLflow and TensorBoard sinks of the simulation's
    #: rounds (``run_simulation(tracking=...)`` comes first); None for none.
    tracking: TrackingConfig | None = None

    @classmethod
    def from_file(cls, path: Path | str) -> SimulationJob:
        """Reads a job file (the format of ``fedlink job submit``, TOML or JSON).

        Its component types are checked by the simulation, which knows the app's registry.

        Raises:
            InvalidArgument: the file or its model is missing or malformed (the message names the key).
        """
        from fedlink.server.cli.jobfile import load_job_file

        loaded = load_job_file(Path(path), check_components=False)
        return cls(
            name=loaded.name,
            workflow=loaded.workflow,
            model=DXO.from_bytes(loaded.model_bytes),
            job_data=loaded.job_data,
            device_selector=dict(loaded.device_selector),
            simulation=loaded.simulation,
            tracking=loaded.tracking,
        )

    @property
    def spec(self) -> WorkflowSpec:
        """The job's workflow spec (a built-in's every parameter written out).

        Raises:
            InvalidArgument: the workflow is not a built-in's parameters or a spec.
        """
        if isinstance(self.workflow, WorkflowSpec):
            return self.workflow
        if isinstance(self.workflow, WorkflowParams):
            return registry.spec_of(self.workflow)
        raise InvalidArgument(
            f"workflow must be a built-in's parameters (e.g. FedAvgParams) or a WorkflowSpec, not "
            f"{type(self.workflow).__name__}"
        )

    def params(self) -> WorkflowParams | None:
        """The parameters of a built-in workflow (checked); None for an import-path workflow.

        Raises:
            InvalidArgument: an unknown workflow or a bad parameter.
        """
        spec = self.spec
        return None if spec.is_import_path else registry.parse(spec)

    def with_seed(self, seed: int | None) -> SimulationJob:
        """This job with its workflow's sampling seed replaced (unchanged for None, or a workflow of
        one's own: its config is its own)."""
        params = self.params()
        if seed is None or params is None:
            return self
        return replace(self, workflow=params.with_seed(seed))

    def model_dxo(self) -> DXO:
        """The initial model as a WEIGHTS DXO.

        Raises:
            InvalidArgument: the model is empty, not WEIGHTS, or holds something that is not an array.
        """
        dxo = self.model if isinstance(self.model, DXO) else DXO(kind=DataKind.WEIGHTS, data=dict(self.model))
        if dxo.kind is not DataKind.WEIGHTS:
            raise InvalidArgument(f"the initial model must be a WEIGHTS DXO, not {dxo.kind}")
        if not dxo.data:
            raise InvalidArgument("the initial model has no variables")
        dxo.validate()
        return dxo

    def job_data_json(self) -> str:
        """``job_data`` as the JSON text the coordinator stores ("" for none).

        Raises:
            InvalidArgument: it is not a JSON object.
        """
        if isinstance(self.job_data, str):
            if not self.job_data:
                return ""
            try:
                document = json.loads(self.job_data)
            except ValueError as exc:
                raise InvalidArgument(f"job_data is not valid JSON: {exc}") from None
        else:
            document = self.job_data
        if not isinstance(document, Mapping):
            raise InvalidArgument("job_data must be a JSON object (the runner config)")
        try:
            return json.dumps(document, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"job_data cannot be written as JSON: {exc}") from None
