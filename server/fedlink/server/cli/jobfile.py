"""The job file of ``fedlink job submit`` and ``fedlink simulate``: TOML or JSON describing a job and
its initial model.

::

    name = "digits"
    model = "initial.npz"                      # .npz or .safetensors, relative to this file
    device_selector = { platform = "linux" }   # optional: device_info pairs a device must have

    [fedavg]                                   # the workflow: exactly one section naming it
    num_rounds = 5
    fraction = 1.0                             # or devices_per_round = 3
    min_results = 2
    round_timeout = "60s"
    min_devices = 2
    seed = 0
    evaluate = false
    round_failure_policy = "retry"             # or "fail"
    max_round_retries = 2
    keep_checkpoints = 3

    [job_data]                                 # the runner config (NVFlare edge format)
    components = [{ type = "SoftmaxRegressionTrainer", name = "trainer", args = { epochs = 1 } }]
    executors = { "*" = "@trainer" }

    [simulation]                               # optional: what `fedlink simulate` gives its devices
    devices = 10                               # the default of --devices
    data = "digits.npz"                        # relative to this file; --data replaces it
    partition = "dirichlet"                    # or "iid"; as fedlink runner --partition
    partition_alpha = 0.5
    partition_seed = 0

The workflow section is one of the built-in workflows' names (``fedavg``, ``fedavgm``, ``fedadam``,
``fedyogi``, ``fedadagrad``, ``fedmedian``, ``fedtrimmedavg``, ``krum``), holding FedAvg's round keys
above plus the strategy's own (``server_learning_rate = 0.05`` for ``[fedadam]``), or ``[workflow]``
for a workflow of one's own::

    [workflow]
    name = "flows.cyclic:workflow"             # an import path the coordinator allows
    config = { num_rounds = 3 }                # handed to the factory as JSON

Everything is checked here, before anything is sent: an unknown key, a value of the wrong type, a
parameter out of range, a model file that is missing or holds anything but int/float arrays, a
``job_data`` the coordinator would refuse (:func:`fedlink.runner.validation.check_job_data`: a
dangling ``@ref``, a task of the workflow with no executor, a built-in type's unknown arg; the type
names themselves are checked by the coordinator, which knows which its devices register) — each is
a :class:`~fedlink.common.errors.InvalidArgument` naming the file and the key. (A custom workflow's
config is checked by the coordinator that runs it.)

Relative paths are relative to the job file, wherever the command runs: the model, the
``[simulation]`` data, and the file args of the built-in data sources in ``job_data``
(``NpzDataSource.path``, ``CsvDataSource.train``/``valid``/``test``), which are sent as absolute
paths and must exist. An absolute path in ``job_data`` is a path on the devices and is not checked
here. The ``[simulation]`` section is read by ``fedlink simulate`` only; ``fedlink job submit`` checks
it and sends nothing of it.
"""

from __future__ import annotations

import json
import tomllib
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from fedlink.common.dxo import DXO, DataKind
from fedlink.common.errors import InvalidArgument
from fedlink.runner.data import DeviceData
from fedlink.runner.data.partition import PartitionMethod
from fedlink.runner.validation import check_job_data, resolve_paths
from fedlink.server.domain import WorkflowSpec
from fedlink.server.tracking.sinks import TrackingConfig
from fedlink.server.workflows import registry
from fedlink.server.workflows.wire import spec_to_wire
from fedlink.v1 import control_service_pb2 as cpb

#: The section of a workflow of one's own (``name`` and ``config``).
CUSTOM_SECTION: Final = "workflow"
#: The section read by ``fedlink simulate`` only.
SIMULATION_SECTION: Final = "simulation"
TRACKING_SECTION: Final = "tracking"
_COMMON_KEYS: Final = frozenset(
    {"name", "model", "device_selector", "job_data", SIMULATION_SECTION, TRACKING_SECTION}
)
_TRACKING_KEYS: Final = ("mlflow_tracking_uri", "mlflow_experiment", "tensorboard_dir")
_SIMULATION_KEYS: Final = (
    "devices",
    "data",
    "partition",
    "partition_alpha",
    "partition_seed",
    "heterogeneity",
)
_MAX_NAME: Final = 128  # the control protocol's limit (JobSpec.name)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobFile:
    """A checked job file: what to submit, and the initial model as the bytes to upload."""

    path: Path
    name: str
    #: The workflow and its parameters (a built-in's checked; a custom one's config as written).
    workflow: WorkflowSpec
    #: The runner configuration as the JSON document the coordinator stores.
    job_data: str = field(repr=False)
    device_selector: Mapping[str, str]
    model_path: Path
    #: The initial model: a serialized ``Dxo`` of kind WEIGHTS (deterministic, so re-uploads dedupe).
    model_bytes: bytes = field(repr=False)
    #: The ``[simulation]`` section (defaults when the file has none).
    simulation: SimulationSection = field(default_factory=lambda: SimulationSection())
    #: The ``[tracking]`` section: where ``fedlink simulate`` logs the rounds' metrics (None: nowhere).
    #: ``fedlink job submit`` sends none of it: a coordinator logs where its operator says.
    tracking: TrackingConfig | None = None

    def spec(self, model_sha256: str, model_size: int) -> cpb.JobSpec:
        """The wire job spec, with the uploaded model's reference."""
        spec = cpb.JobSpec(name=self.name, job_data=self.job_data, device_selector=dict(self.device_selector))
        spec_to_wire(self.workflow, spec)
        spec.initial_model.sha256 = model_sha256
        spec.initial_model.size_bytes = model_size
        return spec


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationSection:
    """A job file's ``[simulation]`` section: what ``fedlink simulate`` gives its virtual devices."""

    #: How many virtual devices (the default of ``--devices``); None if the file does not say.
    devices: int | None = None
    #: The ``.npz`` file every virtual device gets its partition of (resolved against the job file).
    data: Path | None = None
    #: How the data is split, as ``fedlink runner``'s settings of the same names split it.
    partition: PartitionMethod = "iid"
    partition_alpha: float = 0.5
    partition_seed: int = 0
    #: The ``[simulation.heterogeneity]`` table as written (the simulation checks it, see
    #: ``fedlink.simulation.Heterogeneity.from_table``); None if the file has none.
    heterogeneity: Mapping[str, Any] | None = None

    def device_data(self, data: Path | None = None) -> DeviceData | None:
        """The devices' data: ``data`` (e.g. ``--data``) or the section's file, split as the section
        says; None without either.

        Raises:
            InvalidArgument: The file does not exist (the message names it).
        """
        path = data if data is not None else self.data
        if path is None:
            return None
        if not path.is_file():
            said = "--data" if data is not None else f"{SIMULATION_SECTION}.data"
            raise InvalidArgument(f"{said}: data file {path} does not exist")
        return DeviceData(
            path=path,
            partition=self.partition,
            alpha=self.partition_alpha,
            seed=self.partition_seed,
        )


def load_job_file(path: Path, *, check_components: bool = True) -> JobFile:
    """Reads and checks a job file and loads its model.

    Args:
        path: The ``.toml`` or ``.json`` file.
        check_components: Check ``job_data``'s component types as the coordinator will (off for a
            simulation whose app registers types of its own: it checks them knowing those).

    Raises:
        InvalidArgument: the file or its model is missing or malformed; the message names the key.
    """
    document = _read_document(path)
    where = str(path)
    sections = set(registry.BUILTIN) | {CUSTOM_SECTION}
    unknown = sorted(set(document) - _COMMON_KEYS - sections)
    if unknown:
        allowed = ", ".join(sorted(_COMMON_KEYS))
        raise InvalidArgument(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {allowed} and one workflow section "
            f"({', '.join(sorted(sections))})"
        )
    name = _required(document, "name", where)
    if not isinstance(name, str) or not 0 < len(name.strip()) <= _MAX_NAME:
        raise InvalidArgument(f"{where}: name must be a string of 1 to {_MAX_NAME} characters")
    model = _required(document, "model", where)
    if not isinstance(model, str) or not model:
        raise InvalidArgument(f"{where}: model must be the path of a .npz or .safetensors file")
    model_path = Path(model).expanduser()
    if not model_path.is_absolute():
        model_path = path.parent / model_path  # relative to the job file, so it works from anywhere
    selector = _selector(document.get("device_selector", {}), where)
    workflow = _workflow(document, where)
    # Absolute: job_data goes to devices, which open files from wherever they run.
    base = path.resolve().parent
    job_data = _job_data(
        document.get("job_data", {}), where, base=base, workflow=workflow, check=check_components
    )
    simulation = _simulation(document.get(SIMULATION_SECTION, {}), where, base=base)
    tracking = _tracking(document.get(TRACKING_SECTION), where, base=base)
    return JobFile(
        path=path,
        name=name.strip(),
        workflow=workflow,
        job_data=job_data,
        device_selector=selector,
        model_path=model_path,
        model_bytes=_model_bytes(model_path, where),
        simulation=simulation,
        tracking=tracking,
    )


def _read_document(path: Path) -> dict[str, Any]:
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise InvalidArgument(f"{path}: a job file is .toml or .json")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise InvalidArgument(f"job file {path} does not exist") from None
    except OSError as exc:
        raise InvalidArgument(f"cannot read job file {path}: {exc.strerror}") from None
    try:
        if suffix == ".toml":
            document: object = tomllib.loads(raw.decode())
        else:
            document = json.loads(raw)
    except UnicodeDecodeError:
        raise InvalidArgument(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{path}: not valid TOML: {exc}") from None
    except ValueError as exc:
        raise InvalidArgument(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise InvalidArgument(f"{path}: the job must be a JSON object")
    return document


def _required(table: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in table:
        raise InvalidArgument(f"{where}: {key} is missing")
    return table[key]


def _selector(value: object, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: device_selector must be a table of strings")
    for key, item in value.items():
        if not isinstance(item, str):
            raise InvalidArgument(
                f"{where}: device_selector.{key} must be a string, not {type(item).__name__}"
            )
    return dict(value)


def _job_data(value: object, where: str, *, base: Path, workflow: WorkflowSpec, check: bool) -> str:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: job_data must be a table (the runner config)")
    try:
        text = json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        # TOML dates and times, or NaN/infinity, have no JSON form.
        raise InvalidArgument(f"{where}: job_data cannot be sent as JSON: {exc}") from None
    if not value:
        return text
    document, resolved = resolve_paths(value, base)
    for key, file in resolved:
        if not file.exists():
            raise InvalidArgument(
                f"{where}: job_data {key}: file {file} does not exist (a relative path is relative "
                "to the job file)"
            )
    if check:
        try:
            # The type names are the coordinator's to check: only it knows its component_types.
            check_job_data(
                document,
                task_names=registry.task_names(workflow),
                known_types=("*",),
                workflow=f"the {workflow.name} workflow",
            )
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where}: {exc.message}") from None
    return json.dumps(document, sort_keys=True, allow_nan=False)


def _simulation(value: object, where: str, *, base: Path) -> SimulationSection:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: {SIMULATION_SECTION} must be a table ([{SIMULATION_SECTION}])")
    unknown = sorted(set(value) - set(_SIMULATION_KEYS))
    if unknown:
        raise InvalidArgument(
            f"{where}: unknown key(s) in {SIMULATION_SECTION}: {', '.join(unknown)}; allowed: "
            f"{', '.join(_SIMULATION_KEYS)}"
        )
    at = f"{where}: {SIMULATION_SECTION}"
    devices = value.get("devices")
    if devices is not None and (isinstance(devices, bool) or not isinstance(devices, int) or devices < 1):
        raise InvalidArgument(f"{at}.devices must be an integer >= 1, not {devices!r}")
    data = value.get("data")
    if data is not None and (not isinstance(data, str) or not data):
        raise InvalidArgument(f"{at}.data must be the path of an .npz file")
    partition = value.get("partition", "iid")
    if partition not in ("iid", "dirichlet"):
        raise InvalidArgument(f"{at}.partition must be iid or dirichlet, not {partition!r}")
    section = SimulationSection(
        devices=devices,
        data=None if data is None else base / Path(data).expanduser(),
        partition="dirichlet" if partition == "dirichlet" else "iid",
        partition_alpha=value.get("partition_alpha", 0.5),
        partition_seed=value.get("partition_seed", 0),
        heterogeneity=_heterogeneity(value.get("heterogeneity"), at),
    )
    try:  # the same checks as the devices' data will get
        DeviceData(path=Path(), alpha=section.partition_alpha, seed=section.partition_seed)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{at}: {exc.message}") from None
    return section


def _heterogeneity(value: object, at: str) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{at}.heterogeneity must be a table ([{SIMULATION_SECTION}.heterogeneity])")
    return dict(value)


def _tracking(value: object, where: str, *, base: Path) -> TrackingConfig | None:
    if value is None:
        return None
    at = f"{where}: {TRACKING_SECTION}"
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: {TRACKING_SECTION} must be a table ([{TRACKING_SECTION}])")
    unknown = sorted(set(value) - set(_TRACKING_KEYS))
    if unknown:
        raise InvalidArgument(
            f"{at}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(_TRACKING_KEYS)}"
        )
    for key in _TRACKING_KEYS:
        if key in value and (not isinstance(value[key], str) or not value[key].strip()):
            raise InvalidArgument(f"{at}.{key} must be a non-empty string")
    uri = value.get("mlflow_tracking_uri")
    folder = value.get("tensorboard_dir")
    return TrackingConfig(
        mlflow_tracking_uri=None if uri is None else _relative_file_uri(uri, base),
        mlflow_experiment=value.get("mlflow_experiment", "fedlink"),
        tensorboard_dir=None if folder is None else base / Path(folder).expanduser(),
    )


def _relative_file_uri(uri: str, base: Path) -> str:
    """A ``file:`` URI (or a bare folder) relative to the job file, as the file's other paths are."""
    path = uri.removeprefix("file:") if uri.startswith("file:") and not uri.startswith("file://") else None
    if path is None and "://" not in uri and ":" not in uri:
        path = uri
    if path is None or Path(path).expanduser().is_absolute():
        return uri
    return f"file:{base / Path(path)}"


# ---- the workflow section ---------------------------------------------------------------------------


def _workflow(document: Mapping[str, Any], where: str) -> WorkflowSpec:
    named = sorted(key for key in document if key in registry.BUILTIN or key == CUSTOM_SECTION)
    if len(named) != 1:
        choices = ", ".join(f"[{name}]" for name in (*registry.BUILTIN, CUSTOM_SECTION))
        said = f"it has {', '.join(named)}" if named else "it has none"
        raise InvalidArgument(f"{where}: a job needs exactly one workflow section ({choices}); {said}")
    section = named[0]
    table = document[section]
    if not isinstance(table, dict):
        raise InvalidArgument(f"{where}: {section} must be a table ([{section}])")
    try:
        if section == CUSTOM_SECTION:
            return _custom(table)
        params = registry.builtin(section).params.from_table(table, section=section)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: {exc.message}") from None
    spec = registry.spec_of(params)
    # Only what the file says goes to the coordinator, which fills in its own defaults for the rest.
    written = {key for key in table} | {f"{key}_s" for key in table}
    return WorkflowSpec(name=spec.name, config={k: v for k, v in spec.config.items() if k in written})


def _custom(table: Mapping[str, Any]) -> WorkflowSpec:
    unknown = sorted(set(table) - {"name", "config"})
    if unknown:
        raise InvalidArgument(
            f"unknown key(s) in {CUSTOM_SECTION}: {', '.join(unknown)}; allowed: name, config"
        )
    name = table.get("name")
    if not isinstance(name, str) or ":" not in name:
        raise InvalidArgument(f"{CUSTOM_SECTION}.name must be an import path such as 'pkg.module:factory'")
    config = table.get("config", {})
    if not isinstance(config, dict):
        raise InvalidArgument(f"{CUSTOM_SECTION}.config must be a table")
    try:
        json.dumps(config, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{CUSTOM_SECTION}.config cannot be sent as JSON: {exc}") from None
    return WorkflowSpec(name=name, config=config)


# ---- the model ---------------------------------------------------------------------------------------


def _model_bytes(path: Path, where: str) -> bytes:
    arrays = load_model_arrays(path, where=where)
    try:
        return DXO(kind=DataKind.WEIGHTS, data=arrays).to_bytes()
    except InvalidArgument as exc:
        raise InvalidArgument(f"model {path}: {exc.message}") from None


def load_model_arrays(path: Path, *, where: str = "") -> dict[str, npt.NDArray[Any]]:
    """Reads a model's named arrays from a ``.npz`` or ``.safetensors`` file.

    Raises:
        InvalidArgument: the file is missing or unreadable, holds no arrays, or an array that is not of
            an integer or floating dtype.
    """
    prefix = f"{where}: " if where else ""
    if not path.is_file():
        raise InvalidArgument(f"{prefix}model file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        arrays = _load_npz(path, prefix)
    elif suffix == ".safetensors":
        arrays = _load_safetensors(path, prefix)
    else:
        raise InvalidArgument(f"{prefix}model {path}: must be a .npz or .safetensors file")
    if not arrays:
        raise InvalidArgument(f"{prefix}model {path} holds no arrays")
    for name, array in arrays.items():
        if array.dtype.kind not in "iuf":
            raise InvalidArgument(
                f"{prefix}model {path}: array {name!r} has dtype {array.dtype}; only integer and float "
                "arrays can be a model"
            )
    return arrays


def _load_npz(path: Path, prefix: str) -> dict[str, npt.NDArray[Any]]:
    try:
        # Opened here rather than by np.load, which leaks the handle when the archive is corrupt.
        # allow_pickle=False: a model file must never run code; object arrays are refused.
        with path.open("rb") as file:
            loaded = np.load(file, allow_pickle=False)
            if not isinstance(loaded, np.lib.npyio.NpzFile):
                raise InvalidArgument(f"{prefix}model {path} holds one unnamed array, not an .npz archive")
            with loaded as archive:
                return {name: np.asarray(archive[name]) for name in archive.files}
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise InvalidArgument(f"{prefix}model {path} is not a readable .npz file: {exc}") from None


def _load_safetensors(path: Path, prefix: str) -> dict[str, npt.NDArray[Any]]:
    try:
        from safetensors.numpy import load_file  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        raise InvalidArgument(
            f"{prefix}model {path}: reading .safetensors needs the safetensors package "
            "(pip install safetensors), or save the model as .npz"
        ) from None
    try:
        loaded: dict[str, npt.NDArray[Any]] = load_file(str(path))
    except Exception as exc:  # the library raises its own SafetensorError for a malformed file
        raise InvalidArgument(f"{prefix}model {path} is not a readable .safetensors file: {exc}") from None
    return loaded


__all__ = ["JobFile", "SimulationSection", "load_job_file", "load_model_arrays"]
