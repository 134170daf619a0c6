"""Metric sinks: where per-round (or, for FedBuff, per-model-version) metrics go besides the job's events.

One interface, :class:`MetricSink`, with three implementations: :class:`JsonlSink` (one JSON line per
step, what ``fedlink simulate --jsonl`` writes), :class:`MlflowSink` (one MLflow run per job, in a
``file:`` or SQL tracking store; needs ``fedlink[mlflow]``) and :class:`TensorBoardSink` (event files,
one folder per job; needs ``fedlink[tensorboard]``). The coordinator (``fedlink serve``) and the
simulation feed the same sinks (:mod:`fedlink.server.services.tracking`, and
:class:`fedlink.simulation.progress.TrackingProgress`).

A sink never breaks a job: each is wrapped in a :class:`GuardedSink`, which logs a sink's first
failure once, with its traceback, and drops the sink for the rest of the process. Sinks are called
from one thread at a time (never the event loop's: their libraries do blocking I/O).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import IO, Any, Final, Protocol

from fedlink.common.errors import InvalidArgument

log = logging.getLogger(__name__)

__all__ = [
    "GuardedSink",
    "JsonlSink",
    "MetricPoint",
    "MetricSink",
    "MlflowSink",
    "TensorBoardSink",
    "TrackedJob",
    "TrackingConfig",
    "build_sinks",
]

#: Tag of an MLflow run naming the fedlink job it tracks (a resumed job logs on to the same run).
MLFLOW_JOB_TAG: Final = "fedlink.job_id"
#: Prefix of the numbers fedlink logs about a step itself, beside the workflow's metrics.
SYSTEM_PREFIX: Final = "fedlink/"
_MLFLOW_PARAM_CHARS: Final = 500  # MLflow's limit of a param value (older servers: 250)
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackedJob:
    """The job whose metrics a sink receives."""

    job_id: str
    name: str
    #: The workflow's name (``fedavg``, ``fedbuff``, ... or an import path).
    workflow: str
    #: The workflow's parameters as the job runs them (logged as MLflow params).
    params: Mapping[str, Any] = field(default_factory=dict)

    @property
    def step_name(self) -> str:
        """What a step is: ``version`` for FedBuff's model versions, else ``round``."""
        return "version" if self.workflow == "fedbuff" else "round"


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricPoint:
    """The metrics of one closed round (or one model version)."""

    #: The round (or model version) number, from 1.
    step: int
    #: The workflow's metrics (``train_loss``, ``eval_accuracy``, ...).
    metrics: Mapping[str, float]
    #: Devices sampled for the round (FedBuff: the version's selection).
    num_devices: int = 0
    #: Results aggregated (FedBuff: updates in the version).
    num_results: int = 0
    #: Seconds from the round's start (or the previous version) to its close.
    duration_s: float = 0.0
    #: When it closed, as a Unix time in seconds (default: now).
    time_s: float = field(default_factory=time.time)

    def system(self) -> dict[str, float]:
        """fedlink's own numbers about the step, under ``fedlink/``."""
        return {
            f"{SYSTEM_PREFIX}num_devices": float(self.num_devices),
            f"{SYSTEM_PREFIX}num_results": float(self.num_results),
            f"{SYSTEM_PREFIX}duration_s": float(self.duration_s),
        }


class MetricSink(Protocol):
    """Receives each job's metrics as its rounds close."""

    def start(self, job: TrackedJob) -> None:
        """A job's metrics begin (or resume, after a coordinator restart)."""

    def log(self, job: TrackedJob, point: MetricPoint) -> None:
        """One round (or model version) of ``job`` closed."""

    def finish(self, job: TrackedJob, state: str) -> None:
        """``job`` ended in ``state`` (``FINISHED``, ``FAILED`` or ``ABORTED``)."""

    def close(self) -> None:
        """No more calls follow: flush and release what the sink holds."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackingConfig:
    """Which sinks to feed; every field unset means none."""

    #: An MLflow tracking URI: ``file:./mlruns`` (a folder), ``sqlite:///mlflow.db``,
    #: ``postgresql://...``, or an ``http(s)://`` MLflow server.
    mlflow_tracking_uri: str | None = None
    #: The MLflow experiment that the jobs' runs go to (created if missing).
    mlflow_experiment: str = "fedlink"
    #: The folder under which each job gets a folder of TensorBoard event files.
    tensorboard_dir: Path | None = None

    @property
    def enabled(self) -> bool:
        """Whether any sink is configured."""
        return bool(self.mlflow_tracking_uri) or self.tensorboard_dir is not None

    def check(self) -> None:
        """Checks that the configured sinks' libraries are installed.

        Raises:
            InvalidArgument: a sink's library is missing (the message says which extra to install).
        """
        if self.mlflow_tracking_uri and find_spec("mlflow") is None:
            raise InvalidArgument(
                "the MLflow sink (mlflow_tracking_uri) needs MLflow: pip install 'fedlink[mlflow]'"
            )
        if self.tensorboard_dir is not None and find_spec("tensorboardX") is None:
            raise InvalidArgument(
                "the TensorBoard sink (tensorboard_dir) needs tensorboardX: "
                "pip install 'fedlink[tensorboard]'"
            )
        if self.mlflow_tracking_uri is not None and not self.mlflow_experiment.strip():
            raise InvalidArgument("mlflow_experiment must not be empty")


def build_sinks(config: TrackingConfig) -> list[MetricSink]:
    """The configured sinks, each guarded (see :class:`GuardedSink`), in a fixed order.

    Raises:
        InvalidArgument: a configured sink's library is not installed.
    """
    config.check()
    makers: list[tuple[str, Callable[[], MetricSink]]] = []
    if config.mlflow_tracking_uri:
        uri, experiment = config.mlflow_tracking_uri, config.mlflow_experiment
        makers.append(("MlflowSink", lambda: MlflowSink(uri, experiment)))
    if config.tensorboard_dir is not None:
        folder = config.tensorboard_dir
        makers.append(("TensorBoardSink", lambda: TensorBoardSink(folder)))
    sinks: list[MetricSink] = []
    for name, make in makers:
        try:
            sinks.append(GuardedSink(make(), name=name))
        except Exception as exc:  # as a failing sink: logged once, and the jobs run without it
            log.error("metric sink %s could not be set up and is disabled: %s", name, exc, exc_info=exc)
    return sinks


class GuardedSink:
    """Runs a sink so that it cannot break the job: its first failure is logged once, then it is dropped."""

    def __init__(self, sink: MetricSink, *, name: str | None = None) -> None:
        self.sink = sink
        self.name = name or type(sink).__name__
        #: The error that disabled the sink, if one did.
        self.failure: BaseException | None = None

    @property
    def disabled(self) -> bool:
        """Whether a failure disabled the sink."""
        return self.failure is not None

    def _call(self, what: str, *args: Any) -> None:
        if self.failure is not None:
            return
        try:
            getattr(self.sink, what)(*args)
        except Exception as exc:  # a sink's library may raise anything; the job must go on
            self.failure = exc
            log.error(
                "metric sink %s failed in %s and is disabled for the rest of this process: %s",
                self.name,
                what,
                exc,
                exc_info=exc,
                extra={"sink": self.name},
            )
            try:
                self.sink.close()
            except Exception:  # already failing; its close may fail too, and says nothing new
                log.debug("closing the failed sink %s failed as well", self.name, exc_info=True)

    def start(self, job: TrackedJob) -> None:
        """Passes the call on, unless the sink is disabled."""
        self._call("start", job)

    def log(self, job: TrackedJob, point: MetricPoint) -> None:
        """Passes the call on, unless the sink is disabled."""
        self._call("log", job, point)

    def finish(self, job: TrackedJob, state: str) -> None:
        """Passes the call on, unless the sink is disabled."""
        self._call("finish", job, state)

    def close(self) -> None:
        """Passes the call on, unless the sink is disabled."""
        self._call("close")


# ---- JSON lines --------------------------------------------------------------------------------------


class JsonlSink:
    """Appends one JSON object per closed round to a file, flushed as each round closes.

    Each line: ``{"round", "num_devices", "num_results", "duration_s", "metrics": {...}}`` (``round`` is
    the model version for FedBuff). One file holds one job's rounds.
    """

    def __init__(self, path: Path) -> None:
        self._file: IO[str] | None = path.open("w", encoding="utf-8")

    def start(self, job: TrackedJob) -> None:
        """Nothing to do: the file was opened by the constructor."""

    def log(self, job: TrackedJob, point: MetricPoint) -> None:
        """Writes the round's line."""
        if self._file is None:
            return
        line = {
            "round": point.step,
            "num_devices": point.num_devices,
            "num_results": point.num_results,
            "duration_s": point.duration_s,
            "metrics": dict(point.metrics),
        }
        self._file.write(json.dumps(line, sort_keys=True) + "\n")
        self._file.flush()

    def finish(self, job: TrackedJob, state: str) -> None:
        """Nothing to do: every line is flushed as it is written."""

    def close(self) -> None:
        """Closes the file."""
        file, self._file = self._file, None
        if file is not None:
            file.close()


# ---- MLflow ------------------------------------------------------------------------------------------

_MLFLOW_END: Final = {"FINISHED": "FINISHED", "FAILED": "FAILED", "ABORTED": "KILLED"}


class MlflowSink:
    """One MLflow run per job, in experiment ``experiment`` of the tracking store at ``tracking_uri``.

    The run is named after the job and tagged ``fedlink.job_id``; a coordinator that restarts and
    resumes the job logs on to the same run. The workflow's parameters are the run's params; each
    metric is logged with the round (or model version) as its step, beside ``fedlink/num_devices``,
    ``fedlink/num_results`` and ``fedlink/duration_s``. The run ends FINISHED, FAILED or KILLED
    (an aborted job).

    A ``file:`` URI (or a plain folder) is MLflow's file store, which MLflow 3 keeps only behind
    ``MLFLOW_ALLOW_FILE_STORE=true``: naming one is that choice, so this sink sets the variable
    (for the whole process) unless it is already set.
    """

    def __init__(self, tracking_uri: str, experiment: str = "fedlink") -> None:
        from mlflow.tracking import MlflowClient

        if _is_file_store(tracking_uri):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._uri = tracking_uri
        self._client = MlflowClient(tracking_uri=tracking_uri)
        self._experiment_name = experiment
        self._experiment_id: str | None = None
        self._runs: dict[str, str] = {}

    @property
    def tracking_uri(self) -> str:
        """Where the runs go."""
        return self._uri

    def run_id(self, job_id: str) -> str | None:
        """The MLflow run of a job this sink started, if any."""
        return self._runs.get(job_id)

    def _experiment(self) -> str:
        if self._experiment_id is None:
            found = self._client.get_experiment_by_name(self._experiment_name)
            if found is not None:
                self._experiment_id = str(found.experiment_id)
            else:
                self._experiment_id = str(self._client.create_experiment(self._experiment_name))
        return self._experiment_id

    def start(self, job: TrackedJob) -> None:
        """Finds the job's run (a resumed job) or creates it, with the workflow's params."""
        if job.job_id in self._runs:
            return
        experiment = self._experiment()
        found = self._client.search_runs(
            [experiment], filter_string=f"tags.`{MLFLOW_JOB_TAG}` = '{job.job_id}'", max_results=1
        )
        if found:
            run_id = found[0].info.run_id
            if found[0].info.status != "RUNNING":
                self._client.update_run(run_id, status="RUNNING")
        else:
            run = self._client.create_run(
                experiment,
                run_name=f"{job.name} ({job.job_id})",
                tags={
                    MLFLOW_JOB_TAG: job.job_id,
                    "fedlink.job_name": job.name,
                    "fedlink.workflow": job.workflow,
                },
            )
            run_id = run.info.run_id
            from mlflow.entities import Param

            params = [Param("workflow", job.workflow)] + [
                Param(key, _param_text(value)) for key, value in sorted(_flatten(job.params).items())
            ]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self._client.log_batch(run_id, params=params[start : start + 100])
        self._runs[job.job_id] = run_id

    def log(self, job: TrackedJob, point: MetricPoint) -> None:
        """Logs the step's metrics (NaN and infinite values are left out: MLflow stores finite ones)."""
        from mlflow.entities import Metric

        self.start(job)
        stamp = int(point.time_s * 1000)
        values = {**dict(point.metrics), **point.system()}
        metrics = [
            Metric(key=_metric_key(name), value=float(value), timestamp=stamp, step=point.step)
            for name, value in sorted(values.items())
            if math.isfinite(value)
        ]
        for start in range(0, len(metrics), 1000):  # MLflow's batch limit
            self._client.log_batch(self._runs[job.job_id], metrics=metrics[start : start + 1000])

    def finish(self, job: TrackedJob, state: str) -> None:
        """Ends the job's run with the matching MLflow status."""
        run_id = self._runs.pop(job.job_id, None)
        if run_id is not None:
            self._client.set_terminated(run_id, status=_MLFLOW_END.get(state, "FAILED"))

    def close(self) -> None:
        """Forgets the runs (a run still open stays RUNNING: its job goes on after a restart)."""
        self._runs.clear()


def _is_file_store(uri: str) -> bool:
    return uri.startswith("file:") or "://" not in uri


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _param_text(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text[:_MLFLOW_PARAM_CHARS]


def _metric_key(name: str) -> str:
    # MLflow allows letters, digits, _ - . space / (and : on newer servers); anything else becomes _.
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", name) or "_"


# ---- TensorBoard -------------------------------------------------------------------------------------


class TensorBoardSink:
    """TensorBoard event files: one folder per job under ``log_dir``, one scalar per metric.

    The folder is ``<log_dir>/<job name>-<job id>`` (characters other than letters, digits, ``.``,
    ``_`` and ``-`` become ``_``), so ``tensorboard --logdir <log_dir>`` shows each job as a run. The
    step of each scalar is the round (or model version). A resumed job writes a new event file in the
    same folder, which TensorBoard reads as one run. Written with tensorboardX (no TensorFlow needed),
    flushed after every round.
    """

    def __init__(self, log_dir: Path) -> None:
        from tensorboardX import SummaryWriter

        self._root = Path(log_dir).expanduser()
        self._writer_type = SummaryWriter
        self._writers: dict[str, Any] = {}

    def job_dir(self, job: TrackedJob) -> Path:
        """The folder of ``job``'s event files."""
        return self._root / _UNSAFE.sub("_", f"{job.name}-{job.job_id}")

    def start(self, job: TrackedJob) -> None:
        """Opens the job's writer (and its folder)."""
        if job.job_id not in self._writers:
            folder = self.job_dir(job)
            folder.mkdir(parents=True, exist_ok=True)
            # A file of its own per opening (its name is the second and the host, and a job reopened
            # within one second would truncate the first): TensorBoard reads them in name order.
            suffix = f".{time.time_ns():020d}"
            writer = self._writer_type(logdir=str(folder), flush_secs=10, filename_suffix=suffix)
            self._writers[job.job_id] = writer
            params = json.dumps({"workflow": job.workflow, **dict(job.params)}, sort_keys=True, default=str)
            writer.add_text("fedlink/job", f"{job.name} ({job.job_id}): `{params}`", global_step=0)

    def log(self, job: TrackedJob, point: MetricPoint) -> None:
        """Writes one scalar per metric at the step, then flushes."""
        self.start(job)
        writer = self._writers[job.job_id]
        for name, value in sorted({**dict(point.metrics), **point.system()}.items()):
            writer.add_scalar(name, float(value), global_step=point.step, walltime=point.time_s)
        writer.flush()

    def finish(self, job: TrackedJob, state: str) -> None:
        """Closes the job's writer."""
        writer = self._writers.pop(job.job_id, None)
        if writer is not None:
            writer.close()

    def close(self) -> None:
        """Closes every writer still open."""
        writers, self._writers = list(self._writers.values()), {}
        for writer in writers:
            writer.close()
