"""The runner daemon's settings, built once from defaults < TOML file < ``FEDLINK_*`` environment < flags.

Each field is a TOML key of the same name, an environment variable ``FEDLINK_<NAME>`` and a flag
``--<name>`` of ``fedlink runner``. Durations accept ``30s``, ``5m``, ``1h``, ``250ms`` or a number of
seconds; ``job_timeout = "0"`` (or ``"inf"``) waits for a job for ever, ``connect_timeout = "0"`` for the
coordinator. Maps (``device_info``,
``user_info``) are TOML tables, or ``k=v,k=v`` in the environment and repeated ``k=v`` flags.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

from fedlink.common.errors import InvalidArgument

__all__ = [
    "ENV_PREFIX",
    "RunnerSettings",
    "default_state_dir",
    "load_runner_settings",
    "parse_duration",
    "read_secret_file",
]

_log = logging.getLogger(__name__)

ENV_PREFIX: Final = "FEDLINK_"
_MAX_SECRET_BYTES: Final = 4096
_DURATION: Final = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h)?\s*$")
_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def default_state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$STATE_DIRECTORY`` (set by systemd's ``StateDirectory=``), else ``~/.local/state/fedlink-runner``."""
    env = os.environ if environ is None else environ
    systemd = env.get("STATE_DIRECTORY", "").split(":")[0]
    if systemd:
        return Path(systemd)
    return Path(env.get("HOME") or Path.home()) / ".local" / "state" / "fedlink-runner"


@dataclass(frozen=True, slots=True, kw_only=True)
class RunnerSettings:
    """Everything ``fedlink runner`` can be told."""

    server: str = ""
    """``host:port`` of the coordinator (required)."""
    ca_cert: Path | None = None
    """PEM CA file that signed the coordinator's certificate (default: the system's roots)."""
    insecure: bool = False
    """Plaintext gRPC, without TLS; must be asked for explicitly."""
    join_secret: str = field(default="", repr=False)
    """The coordinator's join secret, needed once, for the first enrolment. A flag's value is visible to
    every local user in the process list: prefer ``join_secret_file``."""
    join_secret_file: Path | None = None
    """File holding the join secret, read when the settings are loaded; refused if others may read it."""
    state_dir: Path = field(default_factory=default_state_dir)
    """Where the device keeps its identity and unacknowledged results."""
    job_name: str = ""
    """Only take jobs with this name ("" for any job the device is eligible for)."""
    data: Path | None = None
    """A ``.npz`` file with ``x_train``/``y_train`` (and optionally ``x_valid``/``y_valid``...)."""
    partition_id: int | None = None
    """Use only this partition of ``data`` (with ``num_partitions``)."""
    num_partitions: int | None = None
    """How many partitions ``data`` is split into."""
    partition: str = "iid"
    """How ``data`` is split: ``iid`` or ``dirichlet`` (label skew)."""
    partition_alpha: float = 0.5
    """Dirichlet concentration (smaller: more skew)."""
    partition_seed: int = 0
    """Seed of the split; every device of a federation must use the same."""
    allow_components: tuple[str, ...] = ()
    """Modules a job's component types may be imported from (``pkg.module:Name``): ``fnmatch`` patterns
    such as ``mypkg.*`` (which also allows ``mypkg`` itself); a TOML list, comma-separated in the
    environment, or repeated flags. That is code chosen by whoever submits a job, run on this device:
    empty allows none. Built-in types always load."""
    device_info: dict[str, str] = field(default_factory=dict)
    """Describes the device to job selectors (platform, app version...)."""
    user_info: dict[str, str] = field(default_factory=dict)
    """Describes the device's user."""
    job_timeout: timedelta = timedelta(0)
    """Job discovery: how long to ask for a job before exiting; 0 means for ever."""
    task_wait: timedelta = timedelta(seconds=20)
    """How long one GetTask long poll may wait for a task."""
    per_request: timedelta = timedelta(seconds=30)
    """Deadline of every other call to the coordinator."""
    connect_timeout: timedelta = timedelta(minutes=5)
    """How long the coordinator may stay unreachable (refused, TLS handshake failures, no answer) before
    the runner exits 1 naming the cause; any answer starts the count again. 0 means for ever."""
    shutdown_grace: timedelta = timedelta(seconds=30)
    """On SIGTERM/SIGINT, how long the task in progress may take before it is aborted and released."""
    log_level: str = "INFO"
    """DEBUG, INFO, WARNING, ERROR or CRITICAL."""
    log_format: str = "console"
    """``console`` (readable lines) or ``json`` (one object per line: ``ts``, ``level``, ``logger``,
    ``message``, and the job, task and device ids as fields where there are some)."""

    def __post_init__(self) -> None:
        if not self.server:
            raise InvalidArgument("server is required: --server HOST:PORT or FEDLINK_SERVER")
        if self.insecure and self.ca_cert is not None:
            raise InvalidArgument("insecure and ca_cert exclude each other: pick one")
        if (self.partition_id is None) != (self.num_partitions is None):
            raise InvalidArgument("partition_id and num_partitions go together")
        if self.partition not in ("iid", "dirichlet"):
            raise InvalidArgument(f"partition must be iid or dirichlet, not {self.partition!r}")
        if self.partition_id is not None and self.data is None:
            raise InvalidArgument("partition_id needs data (a .npz file) to split")
        if self.shutdown_grace < timedelta(0):
            raise InvalidArgument("shutdown_grace cannot be negative")
        if self.log_format not in ("console", "json"):
            raise InvalidArgument(f"log_format must be console or json, not {self.log_format!r}")
        if self.join_secret_file is not None and not self.join_secret:
            raise InvalidArgument(
                "join_secret_file is read into join_secret by load_runner_settings: build the settings "
                "with it, or give join_secret"
            )

    @property
    def job_timeout_seconds(self) -> float:
        """``job_timeout`` in seconds, ``math.inf`` for "for ever"."""
        seconds = self.job_timeout.total_seconds()
        return math.inf if seconds <= 0 else seconds


def parse_duration(value: object) -> timedelta:
    """A duration from seconds (a number) or text such as ``30s``, ``5m``, ``250ms``, ``inf``.

    Raises:
        InvalidArgument: Anything else.
    """
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return timedelta(0) if math.isinf(value) else timedelta(seconds=value)
    if isinstance(value, str):
        if value.strip().lower() in ("inf", "forever", "never"):
            return timedelta(0)
        match = _DURATION.match(value)
        if match:
            return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])
    raise InvalidArgument(f"not a duration: {value!r} (use e.g. 30s, 5m, 250ms)")


def _parse_map(value: object) -> dict[str, str]:
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    items = (
        value.split(",")
        if isinstance(value, str)
        else list(value)
        if isinstance(value, list | tuple)
        else None
    )
    if items is None:
        raise InvalidArgument(f"not a map of k=v: {value!r}")
    result: dict[str, str] = {}
    for item in items:
        key, sep, val = str(item).partition("=")
        if not sep or not key.strip():
            raise InvalidArgument(f"not k=v: {item!r}")
        result[key.strip()] = val.strip()
    return result


def _parse_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise InvalidArgument(f"not a boolean: {value!r}")


def _parse_patterns(value: object) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise InvalidArgument(f"not a list of module patterns: {value!r}")
    patterns: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise InvalidArgument(f"not a module pattern: {item!r}")
        patterns.extend(part.strip() for part in item.split(",") if part.strip())
    return tuple(patterns)


def _parse_optional_int(value: object) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise InvalidArgument(f"not an integer: {value!r}")
    try:
        return int(str(value))
    except ValueError:
        raise InvalidArgument(f"not an integer: {value!r}") from None


_CONVERTERS: Final[dict[str, Any]] = {
    "server": str,
    "ca_cert": lambda v: Path(str(v)).expanduser() if v not in (None, "") else None,
    "insecure": _parse_bool,
    "join_secret": str,
    "join_secret_file": lambda v: Path(str(v)).expanduser() if v not in (None, "") else None,
    "state_dir": lambda v: Path(str(v)).expanduser(),
    "job_name": str,
    "data": lambda v: Path(str(v)).expanduser() if v not in (None, "") else None,
    "partition_id": _parse_optional_int,
    "num_partitions": _parse_optional_int,
    "partition": lambda v: str(v).lower(),
    "partition_alpha": float,
    "partition_seed": int,
    "allow_components": _parse_patterns,
    "device_info": _parse_map,
    "user_info": _parse_map,
    "job_timeout": parse_duration,
    "task_wait": parse_duration,
    "per_request": parse_duration,
    "connect_timeout": parse_duration,
    "shutdown_grace": parse_duration,
    "log_level": lambda v: str(v).upper(),
    "log_format": lambda v: str(v).lower(),
}


def _convert(name: str, value: object, source: str) -> object:
    try:
        return _CONVERTERS[name](value)
    except KeyError:
        raise InvalidArgument(
            f"{source}: unknown setting {name!r}; known: {', '.join(_CONVERTERS)}"
        ) from None
    except (InvalidArgument, ValueError, TypeError) as exc:
        raise InvalidArgument(f"{source}: bad value for {name}: {exc}") from None


def load_runner_settings(
    config_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, object] | None = None,
) -> RunnerSettings:
    """Builds the settings: defaults < ``config_file`` (TOML) < ``FEDLINK_*`` environment < ``flags``.

    Raises:
        InvalidArgument: An unreadable file, an unknown key, a bad value (the message names the key
            and where it came from) or an invalid combination.
    """
    values: dict[str, object] = {}
    if config_file is not None:
        try:
            doc = tomllib.loads(Path(config_file).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise InvalidArgument(f"cannot read the runner config {config_file}: {exc}") from None
        doc = doc.get("runner", doc)  # a [runner] table, or top-level keys
        for key, value in doc.items():
            values[key] = _convert(key, value, str(config_file))
    env = os.environ if environ is None else environ
    names = {f.name for f in dataclasses.fields(RunnerSettings)}
    for name in names:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = _convert(name, raw, ENV_PREFIX + name.upper())
    for name, value in (flags or {}).items():
        if value is not None:
            values[name] = _convert(name, value, f"--{name.replace('_', '-')}")
    secret_file = values.get("join_secret_file")
    if isinstance(secret_file, Path):
        if values.get("join_secret"):
            raise InvalidArgument("join_secret and join_secret_file exclude each other: give one")
        values["join_secret"] = read_secret_file(secret_file)
    return RunnerSettings(**values)  # type: ignore[arg-type]


def read_secret_file(path: Path) -> str:
    """The token in a secret file (surrounding whitespace stripped).

    Refused if others may read it; a group-readable one is used with a warning, unless systemd passed
    it (``LoadCredential=``: ``$CREDENTIALS_DIRECTORY`` is private to the service, whatever the mode
    bits of its files show, as systemd grants access with an ACL).

    Raises:
        InvalidArgument: the file is missing, unreadable, accessible by others, empty or not text; the
            message names it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidArgument(f"secret file {path} does not exist") from None
    except OSError as exc:
        raise InvalidArgument(f"cannot open secret file {path}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)  # of the opened file: it cannot be swapped after the check
        mode = stat.S_IMODE(info.st_mode)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"secret file {path} is not a regular file")
        if mode & 0o007:
            raise InvalidArgument(
                f"secret file {path} is accessible by others (mode {mode:04o}); run: chmod 600 {path}"
            )
        if mode & 0o070 and not _from_systemd(path):
            _log.warning("secret file %s is readable by its group (mode %04o); chmod 600 it", path, mode)
        data = os.read(fd, _MAX_SECRET_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_SECRET_BYTES:
        raise InvalidArgument(f"secret file {path} is too large to be a secret")
    try:
        secret = data.decode().strip()
    except UnicodeDecodeError:
        raise InvalidArgument(f"secret file {path} is not text") from None
    if not secret:
        raise InvalidArgument(f"secret file {path} is empty")
    return secret


def _from_systemd(path: Path) -> bool:
    directory = os.environ.get("CREDENTIALS_DIRECTORY", "")
    return bool(directory) and path.resolve().parent == Path(directory).resolve()
