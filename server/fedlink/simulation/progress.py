"""What a running simulation shows: a live progress line; where its per-round metrics go (JSONL, MLflow,
TensorBoard)."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, Protocol

from fedlink.server.tracking import JsonlSink, MetricPoint, MetricSink, TrackedJob
from fedlink.simulation.result import RoundRecord
from fedlink.simulation.transport import LiveCounts

log = logging.getLogger(__name__)

__all__ = ["MetricsFile", "ProgressLine", "ProgressSink", "TrackingProgress"]

#: Metrics shown on the progress line, in this order, when the rounds report them.
_SHOWN = ("train_loss", "train_accuracy", "eval_loss", "eval_accuracy", "val_loss", "val_accuracy")


class ProgressSink(Protocol):
    """Told what the simulation does, as it happens (all calls come from the simulation's event loop)."""

    def round_started(self, round: int, num_devices: int) -> None:
        """A round handed out its tasks to ``num_devices`` devices."""

    def round_closed(self, record: RoundRecord) -> None:
        """A round was aggregated and checkpointed."""

    def tick(self, counts: LiveCounts) -> None:
        """Called a few times a second with the live counts."""

    def close(self) -> None:
        """The simulation is over (whatever the outcome)."""


class ProgressLine:
    """One line on a terminal, rewritten in place: ``round 2/5 [#####.....] busy 8 ok 1532 ...``."""

    def __init__(self, num_rounds: int, num_devices: int, stream: IO[str] | None = None) -> None:
        self._rounds = num_rounds
        self._devices = num_devices
        self._stream = stream or sys.stderr
        self._round = 0
        self._closed = 0
        self._sampled = 0
        self._metrics: dict[str, float] = {}
        self._started = time.monotonic()
        self._width = 0

    def round_started(self, round: int, num_devices: int) -> None:
        self._round, self._sampled = round, num_devices

    def round_closed(self, record: RoundRecord) -> None:
        self._closed = record.round
        self._metrics = dict(record.metrics)

    def tick(self, counts: LiveCounts) -> None:
        bar_len = 20
        filled = round(bar_len * self._closed / self._rounds) if self._rounds else bar_len
        shown = " ".join(f"{k}={self._metrics[k]:.4g}" for k in _SHOWN if k in self._metrics)
        bar = "#" * filled + "." * (bar_len - filled)
        text = (
            f"round {max(self._round, self._closed)}/{self._rounds} [{bar}] "
            f"sampled {self._sampled}/{self._devices} busy {counts.busy} ok {counts.succeeded} "
            f"failed {counts.failed} dropped {counts.dropped} {time.monotonic() - self._started:.1f}s"
            + (f" | {shown}" if shown else "")
        )
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self._stream.write("\r" + text + " " * pad)
        self._stream.flush()

    def close(self) -> None:
        if self._width:
            self._stream.write("\n")
            self._stream.flush()


class TrackingProgress:
    """Hands each closed round to metric sinks (MLflow, TensorBoard, JSON lines): the same sinks as
    ``fedlink serve``'s (:mod:`fedlink.server.tracking`).

    The simulation tells it the job's id once submitted (:meth:`job_submitted`) and its end
    (:meth:`job_ended`). With ``background`` (the default) the sinks are called in order on a thread
    of their own, so that their file and database writes never hold up the simulation's event loop;
    :meth:`close` waits for them.
    """

    def __init__(
        self,
        sinks: Sequence[MetricSink],
        *,
        job_name: str,
        workflow: str,
        params: Mapping[str, Any],
        background: bool = True,
    ) -> None:
        self._sinks = list(sinks)
        self._job = TrackedJob(job_id="", name=job_name, workflow=workflow, params=dict(params))
        self._started = False
        self._ended = False
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedlink-tracking") if background else None
        )

    def _each(self, call: Callable[[MetricSink], None]) -> None:
        def run() -> None:
            for sink in self._sinks:
                call(sink)

        def logged() -> None:
            try:
                run()
            except Exception:  # on the thread nobody would see it: said, not lost
                log.exception("a metric sink failed")

        if self._executor is None:
            run()
        else:
            self._executor.submit(logged)

    def job_submitted(self, job_id: str) -> None:
        """The simulation's job has its id: the sinks start tracking it."""
        self._job = dataclasses.replace(self._job, job_id=job_id)

    def _start(self) -> None:
        if not self._started:
            self._started = True
            job = self._job
            self._each(lambda sink: sink.start(job))

    def round_started(self, round: int, num_devices: int) -> None:
        pass

    def round_closed(self, record: RoundRecord) -> None:
        self._start()
        point = MetricPoint(
            step=record.round,
            metrics=dict(record.metrics),
            num_devices=record.num_devices,
            num_results=record.num_results,
            duration_s=record.duration_s,
        )
        job = self._job
        self._each(lambda sink: sink.log(job, point))

    def job_ended(self, state: str) -> None:
        """The job ended in ``state`` (FINISHED, FAILED, ABORTED)."""
        if not self._ended:
            self._ended = True
            self._start()
            job = self._job
            self._each(lambda sink: sink.finish(job, state))

    def tick(self, counts: LiveCounts) -> None:
        pass

    def close(self) -> None:
        if self._started and not self._ended:
            self.job_ended("FAILED")  # the simulation stopped before its job ended (timeout, Ctrl-C)
        self._each(lambda sink: sink.close())
        if self._executor is not None:
            self._executor.shutdown(wait=True)


class MetricsFile(TrackingProgress):
    """Writes one JSON object per closed round to a file (written and flushed as each round closes).

    Each line: ``{"round", "num_devices", "num_results", "duration_s", "metrics": {...}}``.
    """

    def __init__(self, path: Path) -> None:
        # In the loop's thread: each line is on disk when its round's close is reported.
        super().__init__([JsonlSink(path)], job_name="", workflow="", params={}, background=False)
