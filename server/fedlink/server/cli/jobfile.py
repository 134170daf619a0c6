"""The job file of ``fedlink job submit``: TOML or JSON describing a FedAvg job and its initial model.

::

    name = "digits"
    model = "initial.npz"                      # .npz or .safetensors, relative to this file
    device_selector = { platform = "linux" }   # optional: device_info pairs a device must have

    [fedavg]
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

Everything is checked here, before anything is sent: an unknown key, a value of the wrong type, a
FedAvg parameter out of range, a model file that is missing or holds anything but int/float arrays —
each is a :class:`~fedlink.common.errors.InvalidArgument` naming the file and the key.
"""

from __future__ import annotations

import json
import math
import tomllib
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from fedlink.common.dxo import DXO, DataKind
from fedlink.common.errors import InvalidArgument
from fedlink.server.settings import parse_duration
from fedlink.server.workflows.fedavg import FedAvgParams
from fedlink.v1 import control_service_pb2 as cpb

_TOP_KEYS: Final = frozenset({"name", "model", "device_selector", "fedavg", "job_data"})
_MAX_NAME: Final = 128  # the control protocol's limit (JobSpec.name)
_INT32_MAX: Final = 2**31 - 1
_INT64: Final = (-(2**63), 2**63 - 1)
_POLICIES: Final = {
    "retry": cpb.ROUND_FAILURE_POLICY_RETRY,
    "fail": cpb.ROUND_FAILURE_POLICY_FAIL,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class JobFile:
    """A checked job file: what to submit, and the initial model as the bytes to upload."""

    path: Path
    name: str
    fedavg: cpb.FedAvgConfig = field(repr=False)
    #: The runner configuration as the JSON document the coordinator stores.
    job_data: str = field(repr=False)
    device_selector: Mapping[str, str]
    model_path: Path
    #: The initial model: a serialized ``Dxo`` of kind WEIGHTS (deterministic, so re-uploads dedupe).
    model_bytes: bytes = field(repr=False)

    def spec(self, model_sha256: str, model_size: int) -> cpb.JobSpec:
        """The wire job spec, with the uploaded model's reference."""
        spec = cpb.JobSpec(name=self.name, job_data=self.job_data, device_selector=dict(self.device_selector))
        spec.fedavg.CopyFrom(self.fedavg)
        spec.initial_model.sha256 = model_sha256
        spec.initial_model.size_bytes = model_size
        return spec


def load_job_file(path: Path) -> JobFile:
    """Reads and checks a job file and loads its model.

    Raises:
        InvalidArgument: the file or its model is missing or malformed; the message names the key.
    """
    document = _read_document(path)
    where = str(path)
    unknown = sorted(set(document) - _TOP_KEYS)
    if unknown:
        raise InvalidArgument(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(_TOP_KEYS))}"
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
    fedavg = _fedavg(_required(document, "fedavg", where), where)
    job_data = _job_data(document.get("job_data", {}), where)
    return JobFile(
        path=path,
        name=name.strip(),
        fedavg=fedavg,
        job_data=job_data,
        device_selector=selector,
        model_path=model_path,
        model_bytes=_model_bytes(model_path, where),
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


def _job_data(value: object, where: str) -> str:
    if not isinstance(value, dict):
        raise InvalidArgument(f"{where}: job_data must be a table (the runner config)")
    try:
        return json.dumps(value, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        # TOML dates and times, or NaN/infinity, have no JSON form.
        raise InvalidArgument(f"{where}: job_data cannot be sent as JSON: {exc}") from None


# ---- [fedavg] ----------------------------------------------------------------------------------------


def _int(key: str, low: int = 0, high: int = _INT32_MAX) -> Callable[[object], int]:
    def parse(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"{key} must be a whole number, not {value!r}")
        if not low <= value <= high:
            raise InvalidArgument(f"{key} must be between {low} and {high}, not {value}")
        return value

    return parse


def _fraction(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(f"fraction must be a number in (0, 1], not {value!r}")
    return float(value)


def _bool(key: str) -> Callable[[object], bool]:
    def parse(value: object) -> bool:
        if not isinstance(value, bool):
            raise InvalidArgument(f"{key} must be true or false, not {value!r}")
        return value

    return parse


def _policy(value: object) -> str:
    if not isinstance(value, str) or value not in _POLICIES:
        raise InvalidArgument(f"round_failure_policy must be 'retry' or 'fail', not {value!r}")
    return value


def _timeout(value: object) -> timedelta:
    if isinstance(value, bool):
        raise InvalidArgument(f"round_timeout must be a duration such as '60s', not {value!r}")
    try:
        return parse_duration(value)
    except InvalidArgument as exc:
        raise InvalidArgument(f"round_timeout: {exc.message}") from None


_FEDAVG_FIELDS: Final[Mapping[str, Callable[[object], object]]] = {
    "num_rounds": _int("num_rounds", 1),
    "fraction": _fraction,
    "devices_per_round": _int("devices_per_round"),
    "min_results": _int("min_results"),
    "round_timeout": _timeout,
    "min_devices": _int("min_devices"),
    "seed": _int("seed", *_INT64),
    "evaluate": _bool("evaluate"),
    "round_failure_policy": _policy,
    "max_round_retries": _int("max_round_retries"),
    "keep_checkpoints": _int("keep_checkpoints"),
}


def _fedavg(table: object, where: str) -> cpb.FedAvgConfig:
    if not isinstance(table, dict):
        raise InvalidArgument(f"{where}: fedavg must be a table ([fedavg])")
    unknown = sorted(set(table) - set(_FEDAVG_FIELDS))
    if unknown:
        raise InvalidArgument(
            f"{where}: unknown key(s) in fedavg: {', '.join(unknown)}; allowed: {', '.join(_FEDAVG_FIELDS)}"
        )
    if "num_rounds" not in table:
        raise InvalidArgument(f"{where}: fedavg.num_rounds is missing")
    if "fraction" in table and "devices_per_round" in table:
        raise InvalidArgument(f"{where}: fedavg takes fraction or devices_per_round, not both")
    values: dict[str, Any] = {}
    for key, raw in table.items():
        try:
            values[key] = _FEDAVG_FIELDS[key](raw)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where}: fedavg.{exc.message}") from None
    timeout: timedelta | None = values.pop("round_timeout", None)
    checked = dict(values) if timeout is None else {**values, "round_timeout_s": timeout.total_seconds()}
    try:
        # The coordinator's own checks (ranges, min_results vs devices_per_round), here before upload.
        FedAvgParams(**checked)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{where}: {exc.message}") from None
    policy = _POLICIES[values.pop("round_failure_policy", "retry")]
    config = cpb.FedAvgConfig(round_failure_policy=policy, **values)
    if timeout is not None:
        config.round_timeout.FromTimedelta(timeout)
    return config


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


__all__ = ["JobFile", "load_job_file", "load_model_arrays"]
