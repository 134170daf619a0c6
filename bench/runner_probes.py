"""Timing probes for a real Runner: a timed gRPC transport and executors that do no work.

:class:`TimedGrpcTransport` is the real :class:`GrpcTransport` with clocks around the calls the
Runner makes (GetTask, ReportResult, the blob upload, the durable pending-result write); the executors
note when the Runner's worker thread entered and left them. Together they split a task's wall time,
as the runner experiences it, into the coordinator's part and the runner's own part.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedlink.common.dxo import DXO, DataKind
from fedlink.runner.config import ResolverRegistry
from fedlink.runner.context import Context, ContextKey, Signal
from fedlink.runner.transport.base import Ack, ResultReport, Status, TaskOffer
from fedlink.runner.transport.grpc_transport import GrpcTransport, GrpcTransportConfig
from fedlink.runner.transport.state import PendingResults

__all__ = [
    "FixedUpdateExecutor",
    "NoopExecutor",
    "Probe",
    "TaskTimes",
    "TimedGrpcTransport",
    "registry",
]


@dataclass(slots=True)
class TaskTimes:
    """``time.perf_counter()`` marks of one task, filled in as it goes (0.0: not reached)."""

    task_id: str
    get_start: float = 0.0
    get_end: float = 0.0
    exec_start: float = 0.0
    exec_end: float = 0.0
    report_start: float = 0.0
    report_end: float = 0.0
    #: Seconds spent writing the result to the pending directory (write + fsync + rename + fsync).
    pending_put_s: float = 0.0
    #: ``upload_blob`` (hash + GetBlobUploadStatus + UploadBlob) began and returned; 0.0 if inline.
    upload_start: float = 0.0
    upload_end: float = 0.0
    uploaded_bytes: int = 0
    #: The sha256 the coordinator answered for the uploaded blob.
    uploaded_sha256: str = ""
    ack: str = ""

    @property
    def complete(self) -> bool:
        """Whether every mark from GetTask to the acknowledgement was reached."""
        return all((self.get_start, self.get_end, self.exec_start, self.exec_end, self.report_end))


@dataclass(slots=True)
class Probe:
    """Collects :class:`TaskTimes`; ``all_acked`` is set once ``expected_acks`` reports got OK."""

    expected_acks: int
    tasks: dict[str, TaskTimes] = field(default_factory=dict)
    acks: int = 0
    all_acked: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set by the pending writer, taken by the report in progress (one task at a time).
    last_put_s: float = 0.0
    #: Called just before a report starts (outside its clock), e.g. to reset a peak-memory mark.
    before_report: Callable[[], None] | None = None

    def task(self, task_id: str) -> TaskTimes:
        """The record of ``task_id``, created on first use."""
        return self.tasks.setdefault(task_id, TaskTimes(task_id))

    def acked(self, times: TaskTimes, status: Status) -> None:
        """Counts an acknowledgement."""
        times.ack = str(status)
        if status is Status.OK:
            self.acks += 1
            if self.acks >= self.expected_acks:
                self.all_acked.set()


class _TimedPending(PendingResults):
    """The real pending-result directory, timing each durable write."""

    def __init__(self, pending: PendingResults, probe: Probe) -> None:
        super().__init__(pending.path)
        self._probe = probe

    def put(self, request_id: str, data: bytes, *, blob: bytes | None = None) -> None:
        """Writes durably (as the base class does), noting how long it took."""
        start = time.perf_counter()
        super().put(request_id, data, blob=blob)
        self._probe.last_put_s = time.perf_counter() - start


class TimedGrpcTransport(GrpcTransport):
    """:class:`GrpcTransport` with clocks around GetTask, ReportResult and the blob upload."""

    def __init__(self, config: GrpcTransportConfig, probe: Probe) -> None:
        super().__init__(config)
        self.probe = probe
        self.state.pending = _TimedPending(self.state.pending, probe)
        self._current: TaskTimes | None = None

    async def get_task(self, *, job_id: str, cookie: bytes) -> TaskOffer:
        """GetTask, timed; only calls that hand out a task are kept."""
        start = time.perf_counter()
        offer = await super().get_task(job_id=job_id, cookie=cookie)
        end = time.perf_counter()
        if offer.status is Status.OK:
            times = self.probe.task(offer.task_id)
            times.get_start, times.get_end = start, end
        return offer

    async def report_result(self, report: ResultReport) -> Ack:
        """ReportResult (with its pending write and any blob upload), timed."""
        times = self.probe.task(report.task_id)
        if self.probe.before_report is not None:
            self.probe.before_report()
        self._current = times
        times.report_start = time.perf_counter()
        try:
            ack = await super().report_result(report)
        finally:
            times.report_end = time.perf_counter()
            times.pending_put_s = self.probe.last_put_s
            self._current = None
        self.probe.acked(times, ack.status)
        return ack

    async def upload_blob(self, data: bytes) -> str:
        """The blob upload of a large result, timed."""
        start = time.perf_counter()
        sha = await super().upload_blob(data)
        if self._current is not None:
            self._current.upload_start, self._current.upload_end = start, time.perf_counter()
            self._current.uploaded_bytes = len(data)
            self._current.uploaded_sha256 = sha
        return sha


class NoopExecutor:
    """Returns a zero WEIGHT_DIFF shaped like the task's model at once (one example's weight)."""

    def __init__(self, probe: Probe) -> None:
        self._probe = probe

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """No work: the result is ready as soon as the input is."""
        times = self._probe.task(str(ctx[ContextKey.TASK_ID]))
        times.exec_start = time.perf_counter()
        result = DXO(
            kind=DataKind.WEIGHT_DIFF,
            data={name: np.zeros_like(value) for name, value in dxo.data.items()},
            meta={"num_examples": 1},
        )
        times.exec_end = time.perf_counter()
        return result


class FixedUpdateExecutor:
    """Returns one prepared update (built before the clock starts), whatever the task."""

    def __init__(self, probe: Probe, update: DXO) -> None:
        self._probe = probe
        self._update = update

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """Hands back the prepared update."""
        times = self._probe.task(str(ctx[ContextKey.TASK_ID]))
        times.exec_start = times.exec_end = time.perf_counter()
        return self._update


def registry(probe: Probe, update: DXO | None = None) -> ResolverRegistry:
    """The app's resolver registry: ``NoopExecutor`` and, with ``update``, ``FixedUpdateExecutor``."""
    entries: dict[str, Any] = {"NoopExecutor": lambda: NoopExecutor(probe)}
    if update is not None:
        entries["FixedUpdateExecutor"] = lambda: FixedUpdateExecutor(probe, update)
    return ResolverRegistry(entries)
