"""The coordinator's settings, built once from defaults < TOML file < ``FEDLINK_*`` environment < flags.

There is no global settings object: the CLI calls :func:`load_settings` once and passes the result to
the coordinator, and tests construct :class:`CoordinatorSettings` directly.

Everything lives under one data directory by default (``$XDG_DATA_HOME/fedlink``, else
``~/.local/share/fedlink``): the SQLite database, the blobs, the self-signed TLS material, the join
secret and the admin token. A per-user location (rather than one relative to the working directory)
lets ``fedlink job ...`` find the admin token wherever it is run from; a system service sets
``FEDLINK_DATA_DIR=/var/lib/fedlink``.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
import math
import os
import re
import sys
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cache
from pathlib import Path
from typing import Any, Final, Literal

from fedlink.common.errors import InvalidArgument

#: Prefix of the environment variables that set coordinator settings (``FEDLINK_DB_URL``, ...).
ENV_PREFIX: Final = "FEDLINK_"

LogFormat = Literal["console", "json"]
LoopKind = Literal["auto", "uvloop", "asyncio"]

# Identity-checked stand-in for "derive from data_dir": no caller can pass this very object.
_DERIVED_PATH: Final = Path("<derived from data_dir>")
#: The data directory's own secret files, created on first start.
JOIN_SECRET_FILE: Final = "join-secret"
ADMIN_TOKEN_FILE: Final = "admin-token"
_URL_PASSWORD: Final = re.compile(r"(://[^:/@]*:)[^@]*@")
#: What a derived device_offline_after adds to a polling device's longest silence: the jitter of its
#: waits, a slow network, the batching of last-seen writes.
_OFFLINE_MARGIN: Final = timedelta(seconds=10)


def default_data_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The per-user data directory: ``$XDG_DATA_HOME/fedlink``, else ``~/.local/share/fedlink``.

    Args:
        environ: The environment to read ``XDG_DATA_HOME`` and ``HOME`` from (default: the process's).
    """
    env = os.environ if environ is None else environ
    xdg = env.get("XDG_DATA_HOME", "")
    if xdg and Path(xdg).is_absolute():  # The XDG spec says to ignore relative values.
        return Path(xdg) / "fedlink"
    home = env.get("HOME", "")
    return (Path(home) if home else Path.home()) / ".local" / "share" / "fedlink"


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorSettings:
    """Everything ``fedlink serve`` can be told; each field is also ``FEDLINK_<NAME>`` and a flag."""

    data_dir: Path = field(default_factory=default_data_dir)
    """Directory holding the SQLite database, blobs, TLS material, join secret and admin token."""

    db_url: str = field(default="", repr=False)  # may hold a password: see redacted_db_url
    """SQLAlchemy URL of the state store; empty means the SQLite file ``<data_dir>/fedlink.db``."""

    blob_dir: Path = _DERIVED_PATH
    """Directory of the content-addressed blob store (default ``<data_dir>/blobs``)."""

    blobs_in_database: bool = False
    """Keep blob bytes in the database, in chunked rows, instead of under ``blob_dir``: what several
    coordinators on one PostgreSQL need when they share no file system (see docs/operating.md)."""

    listen_address: str = "127.0.0.1:8443"
    """``host:port`` the gRPC server binds; use ``0.0.0.0:8443`` to accept devices from other hosts."""

    insecure: bool = False
    """Serve plaintext gRPC, without TLS. Only for tests and trusted networks."""

    tls_cert: Path | None = None
    """PEM server certificate (chain); without it a self-signed CA and certificate are made in data_dir."""

    tls_key: Path | None = None
    """PEM private key of ``tls_cert``; given together with it."""

    tls_client_ca: Path | None = None
    """PEM CA bundle; when given, every client must present a certificate it signed (mutual TLS)."""

    tls_hostnames: tuple[str, ...] = ("localhost", "127.0.0.1")
    """DNS names and IP addresses the self-signed certificate is valid for (comma-separated in env)."""

    open_enrolment: bool = False
    """Let any device enrol without the join secret."""

    join_secret: str | None = field(default=None, repr=False)
    """Secret a device presents to enrol; unset: read from join_secret_file. A flag's value is visible to
    every local user in the process list: prefer join_secret_file."""

    join_secret_file: Path = _DERIVED_PATH
    """File holding the join secret (default ``<data_dir>/join-secret``, created 0600 with a new secret if
    missing). A file named here must exist and must not be readable by others (group-readable: a warning)."""

    admin_token: str | None = field(default=None, repr=False)
    """Operator credential for ControlService; unset: read from admin_token_file. A flag's value is visible
    to every local user in the process list: prefer admin_token_file."""

    admin_token_file: Path = _DERIVED_PATH
    """File holding the admin token (default ``<data_dir>/admin-token``, created 0600 with a new token if
    missing). A file named here must exist and must not be readable by others (group-readable: a warning)."""

    metrics_address: str | None = None
    """``host:port`` of the Prometheus ``/metrics`` endpoint (e.g. ``127.0.0.1:9464``); unset: none."""

    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI that each job's per-round metrics are logged to, one run per job:
    ``file:/var/lib/fedlink/mlruns``, ``sqlite:///mlflow.db``, ``postgresql://...`` or an MLflow server's
    ``http(s)://`` address (needs ``fedlink[mlflow]``); unset: none."""

    mlflow_experiment: str = "fedlink"
    """MLflow experiment that the jobs' runs go to (created if missing)."""

    tensorboard_dir: Path | None = None
    """Folder of TensorBoard event files: each job's per-round metrics go to ``<dir>/<name>-<job id>``
    (needs ``fedlink[tensorboard]``); unset: none."""

    log_format: LogFormat = "console"
    """Log output: ``console`` (readable lines) or ``json`` (one object per line)."""

    log_level: str = "INFO"
    """Threshold of the coordinator's log: DEBUG, INFO, WARNING, ERROR or CRITICAL."""

    loop: LoopKind = "auto"
    """Event loop: ``auto`` (uvloop when installed), ``uvloop`` (required) or ``asyncio``."""

    shutdown_grace: timedelta = timedelta(seconds=10)
    """On SIGTERM, how long in-flight calls may take to finish before they are cancelled."""

    max_task_wait: timedelta = timedelta(seconds=30)
    """Upper bound on how long a GetTask long poll is held, whatever the device asks for."""

    default_task_wait: timedelta = timedelta(seconds=20)
    """How long a GetTask long poll is held when the device does not say."""

    lease: timedelta = timedelta(minutes=5)
    """How long a device holds an assignment before it expires and goes to another device."""

    job_retry_after: timedelta = timedelta(seconds=5)
    """How long a device with no job is told to wait before asking for one again (GetJob's retry_after)."""

    device_offline_after: timedelta | None = None
    """A device that made no call for this long (and holds no lease) goes OFFLINE and is not sampled; a
    runner that stops says so at once (SignOff). Unset: max_task_wait + job_retry_after + 10s, the
    cadence of a polling device with a margin; a value below max_task_wait + job_retry_after is refused,
    since it would count devices that poll as gone."""

    require_approval: bool = False
    """New devices wait in PENDING, not sampled, until an operator approves them with
    ``fedlink device approve ID``."""

    max_devices: int | None = None
    """Most enrolled devices that are not revoked; more enrolments get RESOURCE_EXHAUSTED. Unset: no cap."""

    enrolments_per_minute: int = 6000
    """Rate limit of new enrolments once enrolment_burst is spent (RESOURCE_EXHAUSTED with retry_after);
    0 turns it off. Retries of an enrolment are not counted."""

    enrolment_burst: int = 1000
    """Enrolments accepted at once before enrolments_per_minute applies."""

    enrolment_replay_window: timedelta = timedelta(minutes=5)
    """How long after its first Enroll a device's retry with the same request_id (and the same request)
    gets its credential again; later, or for another request, the credential is never shown again."""

    max_message_bytes: int = 64 * 1024**2
    """Largest gRPC message accepted or sent; bigger payloads travel as chunked blobs."""

    inline_payload_bytes: int = 2 * 1024**2
    """Tasks whose model is larger than this carry a blob reference instead of the model itself."""

    reaper_interval: timedelta = timedelta(seconds=1)
    """How often expired leases, closed deadlines and offline devices are swept."""

    run_lease: timedelta = timedelta(seconds=30)
    """How long the lease that lets this coordinator drive a run holds without a renewal (renewed every
    third of it). Among replicas on one database, a driver silent for this long loses its runs to
    another replica; its writes from then on are refused (they are fenced by the lease)."""

    loop_failure_timeout: timedelta = timedelta(minutes=2)
    """How long a background loop (job supervisor, maintenance, collection, metrics) may keep failing,
    retried with backoff, before the coordinator gives up: health turns NOT_SERVING and ``fedlink serve``
    exits 3.
    The database being unreachable is not such a failure: it is waited out, however long it lasts."""

    store_retry_budget: timedelta = timedelta(seconds=10)
    """How long one store call retries a dropped or refused database connection (reconnecting, running
    its transaction again) before the store counts as away: devices then get UNAVAILABLE with a
    ``retry_after`` and health says NOT_SERVING until the database answers again."""

    keep_checkpoints: int = 3
    """Round checkpoints kept per run besides the final model, unless a job says otherwise."""

    collection_interval: timedelta = timedelta(minutes=10)
    """How often what nothing uses any more is collected: unused blobs, idle partial uploads, the events
    of long-finished jobs (see docs/storage.md)."""

    unused_blob_ttl: timedelta = timedelta(hours=1)
    """A blob nothing uses (a device's upload it never reported, a model uploaded and never submitted, a
    checkpoint left by a crash) is deleted once it has been stored this long. At least the lease: a
    device reports an uploaded result within its lease."""

    stale_upload_ttl: timedelta = timedelta(hours=24)
    """A partial upload that received no bytes for this long is discarded with its bytes (a device that
    lost its connection resumes within it)."""

    device_upload_quota_bytes: int = 4 * 1024**3
    """Most bytes a device may hold in uploads it has not used: partial ones plus complete ones it has
    not reported as a result. Beyond it UploadBlob is RESOURCE_EXHAUSTED until some are reported or
    collected. Keep it above the largest result a device sends (at most 2GiB)."""

    finished_job_events_ttl: timedelta = timedelta(days=30)
    """How long a finished job keeps its progress events; after that only its last one (how it ended)."""

    max_finished_job_events: int = 10_000
    """Most progress events a finished job keeps (its newest); a pending or running job keeps them all
    (``fedlink job watch`` replays them)."""

    allow_workflows: tuple[str, ...] = ()
    """Modules whose workflows a job may name by import path (``pkg.module:factory``): fnmatch patterns
    such as ``mypkg.*`` (comma-separated in env). That is code run in the coordinator: empty allows none."""

    component_types: tuple[str, ...] = ()
    """Component type names the devices' own apps register (fnmatch patterns, comma-separated in env),
    accepted in a job's job_data besides the built-in types and ``pkg.module:Name`` import paths; every
    other name is refused at submission as a misspelling."""

    max_buffered_round_bytes: int = 2 * 1024**3
    """Most bytes of updates a round may hold in memory: robust aggregation (median, trimmed mean, Krum)
    keeps a round's updates, so a job whose devices_per_round × model size exceeds this is refused."""

    auto_migrate: bool | None = None
    """Apply pending schema migrations at start; unset: yes for SQLite, no for other databases."""

    def __post_init__(self) -> None:
        # Derived defaults are filled here so that a built settings object is complete and explicit.
        data_dir = Path(self.data_dir).expanduser()
        object.__setattr__(self, "data_dir", data_dir)
        if not self.db_url:
            object.__setattr__(self, "db_url", f"sqlite+aiosqlite:///{data_dir / 'fedlink.db'}")
        if self.blob_dir is _DERIVED_PATH:
            object.__setattr__(self, "blob_dir", data_dir / "blobs")
        for name, default in (("join_secret_file", JOIN_SECRET_FILE), ("admin_token_file", ADMIN_TOKEN_FILE)):
            given = getattr(self, name)
            path = data_dir / default if given is _DERIVED_PATH else Path(given).expanduser()
            object.__setattr__(self, name, path)
        object.__setattr__(self, "log_level", self.log_level.upper())
        if self.auto_migrate is None:
            object.__setattr__(self, "auto_migrate", self.db_url.startswith("sqlite"))
        if self.device_offline_after is None:
            derived = self.max_task_wait + self.job_retry_after + _OFFLINE_MARGIN
            object.__setattr__(self, "device_offline_after", derived)
        _validate(self)

    @property
    def online_window(self) -> timedelta:
        """``device_offline_after`` as given or derived (never unset once the settings are built)."""
        assert self.device_offline_after is not None  # filled in by __post_init__
        return self.device_offline_after

    @property
    def redacted_db_url(self) -> str:
        """``db_url`` with any password replaced by ``***``, for logs and messages."""
        return _URL_PASSWORD.sub(r"\1***@", self.db_url)

    @property
    def generates_join_secret(self) -> bool:
        """Whether the join secret is the data directory's own file, created when missing."""
        return self.join_secret_file == self.data_dir / JOIN_SECRET_FILE

    @property
    def generates_admin_token(self) -> bool:
        """Whether the admin token is the data directory's own file (``fedlink job ...`` reads it there)."""
        return self.admin_token_file == self.data_dir / ADMIN_TOKEN_FILE

    @property
    def tls_dir(self) -> Path:
        """Where the self-signed CA and server certificate are kept."""
        return self.data_dir / "tls"


def _validate(s: CoordinatorSettings) -> None:
    _validate_serving(s)
    _validate_limits(s)


def _validate_serving(s: CoordinatorSettings) -> None:
    split_address(s.listen_address, what="listen_address")
    if s.metrics_address is not None:
        split_address(s.metrics_address, what="metrics_address")
    if s.mlflow_tracking_uri is not None and not s.mlflow_experiment.strip():
        raise InvalidArgument("mlflow_experiment must not be empty")
    if (s.tls_cert is None) != (s.tls_key is None):
        raise InvalidArgument("tls_cert and tls_key go together: give both, or neither for a self-signed one")
    if s.insecure and (s.tls_cert is not None or s.tls_client_ca is not None):
        raise InvalidArgument("insecure cannot be combined with tls_cert/tls_key/tls_client_ca")
    if s.log_format not in typing.get_args(LogFormat):
        raise InvalidArgument(f"log_format must be console or json, not {s.log_format!r}")
    if s.loop not in typing.get_args(LoopKind):
        raise InvalidArgument(f"loop must be auto, uvloop or asyncio, not {s.loop!r}")
    if not isinstance(logging.getLevelNamesMapping().get(s.log_level.upper()), int):
        raise InvalidArgument(
            f"log_level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, not {s.log_level!r}"
        )
    if not s.tls_hostnames:
        raise InvalidArgument("tls_hostnames needs at least one name")
    if s.join_secret and not s.generates_join_secret:
        raise InvalidArgument("join_secret and join_secret_file exclude each other: give one")
    if s.admin_token and not s.generates_admin_token:
        raise InvalidArgument("admin_token and admin_token_file exclude each other: give one")


def _validate_limits(s: CoordinatorSettings) -> None:
    for name in (
        "shutdown_grace",
        "max_task_wait",
        "default_task_wait",
        "lease",
        "device_offline_after",
        "job_retry_after",
        "enrolment_replay_window",
    ):
        if getattr(s, name) < timedelta(0):
            raise InvalidArgument(f"{name} must not be negative")
    _validate_devices(s)
    if s.reaper_interval <= timedelta(0):
        raise InvalidArgument("reaper_interval must be positive")
    if s.run_lease <= timedelta(0):
        raise InvalidArgument("run_lease must be positive")
    if s.loop_failure_timeout <= timedelta(0):
        raise InvalidArgument("loop_failure_timeout must be positive")
    if s.store_retry_budget < timedelta(0):
        raise InvalidArgument("store_retry_budget must not be negative")
    if s.default_task_wait > s.max_task_wait:
        raise InvalidArgument(
            f"default_task_wait ({s.default_task_wait}) must not exceed max_task_wait ({s.max_task_wait})"
        )
    if s.max_message_bytes < 64 * 1024:
        raise InvalidArgument("max_message_bytes must be at least 64KiB")
    if not 0 < s.inline_payload_bytes <= s.max_message_bytes:
        raise InvalidArgument("inline_payload_bytes must be positive and at most max_message_bytes")
    if s.keep_checkpoints < 0:
        raise InvalidArgument("keep_checkpoints must not be negative")
    _validate_collection(s)
    if s.max_buffered_round_bytes < 1:
        raise InvalidArgument("max_buffered_round_bytes must be positive")


def _validate_devices(s: CoordinatorSettings) -> None:
    polling = s.max_task_wait + s.job_retry_after
    if s.device_offline_after is not None and s.device_offline_after < polling:
        raise InvalidArgument(
            f"device_offline_after ({s.device_offline_after}) must be at least max_task_wait + "
            f"job_retry_after ({polling}): a device that keeps polling would be counted offline"
        )
    if s.job_retry_after <= timedelta(0):
        raise InvalidArgument("job_retry_after must be positive")
    if s.max_devices is not None and s.max_devices < 1:
        raise InvalidArgument("max_devices must be at least 1 (unset: no cap)")
    if s.enrolments_per_minute < 0:
        raise InvalidArgument("enrolments_per_minute must not be negative (0: no limit)")
    if s.enrolment_burst < 1:
        raise InvalidArgument("enrolment_burst must be at least 1")


def _validate_collection(s: CoordinatorSettings) -> None:
    for name in ("collection_interval", "stale_upload_ttl", "finished_job_events_ttl"):
        if getattr(s, name) <= timedelta(0):
            raise InvalidArgument(f"{name} must be positive")
    if s.unused_blob_ttl < max(s.lease, timedelta(minutes=1)):
        raise InvalidArgument(
            f"unused_blob_ttl ({s.unused_blob_ttl}) must be at least the lease ({s.lease}) and a minute: "
            "a device's uploaded result is unused until it reports it, within its lease"
        )
    if s.device_upload_quota_bytes < 1:
        raise InvalidArgument("device_upload_quota_bytes must be positive")
    if s.max_finished_job_events < 1:
        raise InvalidArgument("max_finished_job_events must be at least 1 (a job keeps its last event)")


def split_address(address: str, *, what: str = "address") -> tuple[str, int]:
    """Splits ``host:port`` (``[v6]:port`` for IPv6) into host and port; port 0 asks for a free one.

    Raises:
        InvalidArgument: the text is not ``host:port`` with a port in 0..65535.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(f"{what} must be host:port (e.g. 127.0.0.1:8443), not {address!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


# ---- parsing of durations and sizes ------------------------------------------------------------------

_DURATION_UNITS: Final = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART: Final = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_SIZE: Final = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?", re.IGNORECASE)
_SIZE_PREFIX: Final = {"k": 1, "m": 2, "g": 3, "t": 4}


def parse_duration(value: object) -> timedelta:
    """Reads a duration: ``"250ms"``, ``"30s"``, ``"5m"``, ``"1h30m"``, ``"2d"``, or a number of seconds.

    Raises:
        InvalidArgument: the value is not a duration, or is negative or not finite.
    """
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"a duration must be a finite number of seconds ≥ 0, not {value!r}")
        return timedelta(seconds=value)
    if isinstance(value, str):
        text = value.strip().lower()
        try:
            return parse_duration(float(text))
        except ValueError:
            pass
        parts = _DURATION_PART.findall(text)
        if parts and "".join(n + u for n, u in parts) == text:
            return timedelta(seconds=sum(float(n) * _DURATION_UNITS[u] for n, u in parts))
    raise InvalidArgument(f"not a duration: {value!r} (examples: 250ms, 30s, 5m, 1h, or seconds as a number)")


def parse_size(value: object) -> int:
    """Reads a size in bytes: ``"64MiB"``, ``"2MB"`` (10**6), ``"512KiB"``, ``"1GiB"``, or a number.

    Raises:
        InvalidArgument: the value is not a size, or is negative or fractional in bytes.
    """
    number: float
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and (match := _SIZE.fullmatch(value.strip())):
        unit = (match.group(2) or "b").lower()
        factor = 1 if unit == "b" else (1024 if "i" in unit else 1000) ** _SIZE_PREFIX[unit[0]]
        number = float(match.group(1)) * factor
    else:
        raise InvalidArgument(f"not a size: {value!r} (examples: 64MiB, 2MB, 1048576)")
    if number < 0 or number != int(number):
        raise InvalidArgument(f"a size must be a whole, non-negative number of bytes, not {value!r}")
    return int(number)


def _parse_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
    raise InvalidArgument(f"not a boolean: {value!r} (true/false, yes/no, on/off, 1/0)")


def _parse_int(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise InvalidArgument(f"not a whole number: {value!r}")


def _parse_str(value: object) -> str:
    if isinstance(value, str):
        return value
    raise InvalidArgument(f"not a string: {value!r}")


def _parse_path(value: object) -> Path:
    if isinstance(value, Path):
        return value
    if isinstance(value, str) and value:
        return Path(value)
    raise InvalidArgument(f"not a path: {value!r}")


def _parse_names(value: object) -> tuple[str, ...]:
    items: list[object]
    if isinstance(value, str):
        items = [part.strip() for part in value.split(",")] if value.strip() else []
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        raise InvalidArgument(f"not a list of names: {value!r}")
    if not all(isinstance(item, str) and item for item in items):
        raise InvalidArgument(f"not a list of non-empty names: {value!r}")
    return tuple(str(item) for item in items)


def _choice(options: tuple[str, ...]) -> Callable[[object], str]:
    def parse(value: object) -> str:
        if isinstance(value, str) and value.strip().lower() in options:
            return value.strip().lower()
        raise InvalidArgument(f"must be one of {', '.join(options)}, not {value!r}")

    return parse


def _converter(name: str, hint: object) -> tuple[Callable[[object], object], bool]:
    """The parser for one field, and whether the field accepts "unset" (None)."""
    optional = False
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        optional = True
    if hint is timedelta:
        return parse_duration, optional
    if hint is int:
        return (parse_size if name.endswith("_bytes") else _parse_int), optional
    if hint is bool:
        return _parse_bool, optional
    if hint is Path:
        return _parse_path, optional
    if hint is str:
        return _parse_str, optional
    if typing.get_origin(hint) is Literal:
        return _choice(typing.get_args(hint)), optional
    if typing.get_origin(hint) is tuple:
        return _parse_names, optional
    raise TypeError(f"no parser for setting {name}: {hint!r}")  # a new field type needs one here


@cache
def _converters() -> Mapping[str, tuple[Callable[[object], object], bool]]:
    hints = typing.get_type_hints(CoordinatorSettings)
    return {f.name: _converter(f.name, hints[f.name]) for f in dataclasses.fields(CoordinatorSettings)}


def setting_names() -> tuple[str, ...]:
    """The names of every setting, in declaration order."""
    return tuple(_converters())


def env_var(name: str) -> str:
    """The environment variable of setting ``name`` (``lease`` -> ``FEDLINK_LEASE``)."""
    return ENV_PREFIX + name.upper()


@cache
def setting_docs() -> Mapping[str, str]:
    """The docstring of each setting (for ``fedlink serve --help``), read from this module's source."""
    tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CoordinatorSettings")
    docs: dict[str, str] = {}
    for stmt, after in zip(cls.body, cls.body[1:], strict=False):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


# ---- loading ----------------------------------------------------------------------------------------


def _convert(name: str, value: object, source: str) -> object:
    converters = _converters()
    if name not in converters:
        raise InvalidArgument(f"{source}: unknown setting {name!r}; known: {', '.join(converters)}")
    parse, optional = converters[name]
    if value is None or (optional and value == ""):
        if optional:
            return None
        raise InvalidArgument(f"{source}: {name} needs a value")
    try:
        return parse(value)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{source}: {name}: {exc.message}") from None


def _read_config_file(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as file:
            document = tomllib.load(file)
    except FileNotFoundError:
        raise InvalidArgument(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"config file {path} is not valid TOML: {exc}") from None
    source = f"config file {path}"
    table: dict[str, Any] = document
    if "serve" in document:
        table = document["serve"]
        if not isinstance(table, dict):
            raise InvalidArgument(f"{source}: 'serve' must be a table ([serve])")
        # Other tables may belong to other commands; loose keys beside [serve] are a mistake.
        loose = [key for key, value in document.items() if key != "serve" and not isinstance(value, dict)]
        if loose:
            raise InvalidArgument(f"{source}: {', '.join(loose)} must go under [serve]")
        source += " [serve]"
    values: dict[str, object] = {}
    for name, raw in table.items():
        value = _convert(name, raw, source)
        # Relative paths in a file are relative to the file, so it works from any directory.
        if isinstance(value, Path) and not value.expanduser().is_absolute():
            value = path.parent / value
        values[name] = value
    return values


def _read_environment(environ: Mapping[str, str]) -> dict[str, object]:
    values: dict[str, object] = {}
    for name in _converters():
        key = env_var(name)
        if key in environ:
            values[name] = _convert(name, environ[key], f"environment variable {key}")
    return values


def load_settings(
    *,
    config_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, object] | None = None,
) -> CoordinatorSettings:
    """Builds the settings: defaults < TOML file < ``FEDLINK_*`` environment < ``overrides``.

    Args:
        config_file: A TOML file with a ``[serve]`` table, or the settings as top-level keys.
        environ: The environment to read ``FEDLINK_<SETTING>`` variables from (unknown ``FEDLINK_*``
            variables are left alone: the runner and tests have their own); default: none.
        overrides: Values from command-line flags, by setting name; ``None`` means "not given". Strings
            are parsed like environment values.

    Raises:
        InvalidArgument: an unknown key or a bad value, naming the key and where it came from.
    """
    env = {} if environ is None else environ
    values: dict[str, object] = {}
    if config_file is not None:
        values.update(_read_config_file(config_file))
    values.update(_read_environment(env))
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = _convert(name, value, f"option --{name.replace('_', '-')}")
    if "data_dir" not in values:
        values["data_dir"] = default_data_dir(env)
    try:
        return CoordinatorSettings(**values)  # type: ignore[arg-type]  # each value was converted per field
    except InvalidArgument as exc:
        raise InvalidArgument(f"invalid settings: {exc.message}") from None


__all__ = [
    "ADMIN_TOKEN_FILE",
    "ENV_PREFIX",
    "JOIN_SECRET_FILE",
    "CoordinatorSettings",
    "LogFormat",
    "LoopKind",
    "default_data_dir",
    "env_var",
    "load_settings",
    "parse_duration",
    "parse_size",
    "setting_docs",
    "setting_names",
    "split_address",
]
