"""The Runner: NVIDIA FLARE's edge ``FlareRunner`` loop, made real over a :class:`Transport`.

One state machine (the statuses are the proto's ``RunnerStatus``)::

    open ─► GET_JOB ──OK──► GET_TASK ──OK──► TASK ──► REPORT ──OK / STALE──► GET_TASK
              │  RETRY / NO_JOB: wait retry_after (+ jitter), else backoff; give up after job_timeout ─► end
              │  DONE ─► end
                           │  RETRY: wait retry_after (+ jitter) ─► GET_TASK
                           │  NO_TASK / DONE ─► GET_JOB                         REPORT DONE ─► GET_JOB

* GetJob's DONE (or ``job_timeout`` spent without getting a job) ends the session: :meth:`Runner.run`
  returns. The first job's discovery includes connecting and enrolling: a runner that cannot reach the
  coordinator when its job timeout ends raises :class:`~fedlink.common.errors.Unavailable` with the
  cause, rather than waiting on. GetTask's and ReportResult's DONE end the *job*; GetJob then offers
  the next one (or says DONE, or nothing until the timeout).
* TASK, handed to the runner's :class:`TaskWorker` as a :class:`TaskWork` (executors are synchronous
  numpy code; the default worker runs it on the event loop's default executor, a simulation gives its
  own pool, or a worker that runs it elsewhere): a new :class:`Context` per task
  (runner, data source, components, handlers, task id/name/data, executor, partition) → app in-filters
  then job in-filters → ``BEFORE_TRAIN`` → executor → ``AFTER_TRAIN`` → app out-filters then job
  out-filters. Meanwhile the event loop renews the lease every third of its length (a failed renewal is
  retried with the runner's backoff, never in a tight loop).
* A task that goes wrong — no executor for its name, a bad job config, an executor or filter that
  raises or returns something that is not a valid DXO — is reported as a FAILED result whose message
  is the exception's type and text. The daemon never dies of it.
* :meth:`Runner.stop` stops polling at once; the task in progress gets ``grace`` seconds to finish
  and be reported, then the abort signal is triggered and the assignment is released. ``stop()``
  with no grace aborts immediately (NVFlare's behaviour). The signal is checked between every step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Protocol, TypeVar, runtime_checkable

from fedlink.common.dxo import DXO
from fedlink.common.errors import FedlinkError, InvalidArgument, Unavailable
from fedlink.runner.config import JobConfig, ResolverRegistry, process_job_data
from fedlink.runner.context import Aborted, Context, ContextKey, EventType, Signal
from fedlink.runner.spec import DataSource, Filter
from fedlink.runner.transport.backoff import Backoff
from fedlink.runner.transport.base import ResultReport, Status, TaskOffer, Transport

__all__ = ["ExecutorWorker", "Runner", "TaskRecord", "TaskWork", "TaskWorker", "execute_task", "job_context"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
#: How long a stopping runner waits for an aborted executor to notice, before releasing anyway.
_ABORT_WAIT: Final = 5.0
#: How long a runner that stops waits for the coordinator to take its SignOff.
_SIGN_OFF_WAIT: Final = 5.0
#: Past the job timeout, how often to look again whether the coordinator is still being reached.
_RECHECK_S: Final = 0.5


class _Stopped(Exception):
    """Internal: stop() was called while the loop waited."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskRecord:
    """What happened to one task (also the daemon's one log line per task)."""

    job_id: str
    task_id: str
    task_name: str
    #: SUCCEEDED, FAILED (reported as failed), RELEASED (given back on stop) or ABANDONED (lease lost).
    outcome: str
    duration_s: float
    #: The coordinator's answer to the report or release ("" if none came).
    ack: str = ""
    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskWork:
    """One task's work as a :class:`Runner` hands it to its :class:`TaskWorker`.

    :meth:`run_here` runs it in the calling thread with the Runner's own components and context. A
    worker in another process (the simulation's Ray backend) cannot take those along: it builds the
    components from ``job_data`` and calls :func:`execute_task` with ``task_data``, ``partition`` and
    the app filters instead.
    """

    job_id: str
    #: The job's runner configuration (JSON), as GetJob gave it.
    job_data: str
    task_id: str
    task_name: str
    task_data: DXO | None = field(repr=False)
    #: ``(partition_id, num_partitions)`` of the device, when it has one.
    partition: tuple[int, int] | None
    #: The app's filters (they run before the job's).
    app_in_filters: tuple[Filter, ...] = ()
    app_out_filters: tuple[Filter, ...] = ()
    #: Triggered when the task must stop (the runner stops, or the lease is lost).
    signal: Signal = field(repr=False, compare=False)
    _run_here: Callable[[], DXO] = field(repr=False, compare=False)

    def run_here(self) -> DXO:
        """Runs filters in, executor, filters out in this thread; returns the output DXO.

        Raises:
            Aborted: the signal was triggered.
            Exception: whatever the job config, a filter or the executor raised.
        """
        return self._run_here()


@runtime_checkable
class TaskWorker(Protocol):
    """Where a Runner's task work runs (it is synchronous code: it must not block the event loop)."""

    async def run(self, work: TaskWork) -> DXO:
        """Runs ``work``; returns its output DXO or raises what the work raised."""
        ...


class ExecutorWorker:
    """A :class:`TaskWorker` running the work on a :class:`concurrent.futures.Executor`.

    ``None`` is the event loop's default executor (as ``asyncio.to_thread``).
    """

    def __init__(self, executor: concurrent.futures.Executor | None = None) -> None:
        self.executor = executor

    async def run(self, work: TaskWork) -> DXO:
        """Runs ``work.run_here`` on the executor (with the caller's context variables)."""
        call = contextvars.copy_context().run
        return await asyncio.get_running_loop().run_in_executor(self.executor, call, work.run_here)


@dataclass(slots=True)
class _Job:
    job_id: str
    name: str
    job_data: str
    config: JobConfig | None
    config_error: str
    ctx: Context
    cookie: bytes = b""


class Runner:
    """Runs jobs for one device until the session is done or :meth:`stop` is called.

    The constructor keeps NVFlare's ``FlareRunner`` signature; ``transport`` says how to reach the
    coordinator.
    """

    def __init__(
        self,
        job_name: str,
        data_source: DataSource | None,
        device_info: dict[str, str],
        user_info: dict[str, str],
        job_timeout: float | timedelta,
        in_filters: Sequence[Filter] | None = None,
        out_filters: Sequence[Filter] | None = None,
        resolver_registry: ResolverRegistry | None = None,
        *,
        transport: Transport,
        partition_id: int | None = None,
        num_partitions: int | None = None,
        backoff: Backoff | None = None,
        worker: TaskWorker | concurrent.futures.Executor | None = None,
        allow_components: Sequence[str] = (),
    ) -> None:
        """Creates a runner.

        Args:
            job_name: Only jobs with this name; "" for any job the device is eligible for.
            data_source: The device's data, put in every task's context.
            device_info: Sent with GetJob (platform, app version, capabilities...).
            user_info: Sent with GetJob.
            job_timeout: Job discovery: how long to keep asking for a job before the session ends
                (seconds or a timedelta; ``math.inf`` for ever).
            in_filters: App filters applied before the job's in-filters.
            out_filters: App filters applied before the job's out-filters.
            resolver_registry: Component types of the app, overriding the built-ins.
            transport: How to reach the coordinator; the runner opens and closes it.
            partition_id: This device's data partition, put in the context when given.
            num_partitions: How many partitions there are (with ``partition_id``).
            backoff: Waits when the coordinator has nothing and did not say how long to wait.
            worker: Where task work (filters and executor) runs: a :class:`TaskWorker`, or an
                executor (wrapped in :class:`ExecutorWorker`); default: the event loop's default
                executor.
            allow_components: ``fnmatch`` patterns of the modules a job's component types may be
                imported from (``pkg.module:Name``; ``pkg.*`` also allows ``pkg``); none by default:
                that is code chosen by whoever submitted the job.
        """
        seconds = job_timeout.total_seconds() if isinstance(job_timeout, timedelta) else float(job_timeout)
        if not seconds > 0:
            raise InvalidArgument(f"job_timeout must be positive, got {job_timeout!r}")
        if (partition_id is None) != (num_partitions is None):
            raise InvalidArgument("partition_id and num_partitions go together")
        self.job_name = job_name
        self.data_source = data_source
        self.device_info = dict(device_info)
        self.user_info = dict(user_info)
        self.job_timeout = seconds
        self.app_in_filters = tuple(in_filters or ())
        self.app_out_filters = tuple(out_filters or ())
        self.resolver_registry = resolver_registry
        self.allow_components = tuple(allow_components)
        self.transport = transport
        self.partition: tuple[int, int] | None = None
        if partition_id is not None and num_partitions is not None:
            self.partition = (partition_id, num_partitions)
        self.backoff = backoff or Backoff(base=timedelta(seconds=1), cap=timedelta(seconds=30))
        if worker is None or isinstance(worker, concurrent.futures.Executor):
            worker = ExecutorWorker(worker)
        elif not isinstance(worker, TaskWorker):
            raise InvalidArgument(f"worker must be a TaskWorker or an Executor, not {type(worker).__name__}")
        self.worker: TaskWorker = worker
        #: Triggered by :meth:`stop` (after the grace period); executors and filters see it.
        self.abort_signal = Signal()
        #: Every task this runner finished, oldest first.
        self.history: list[TaskRecord] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        #: The transport calls and waits in progress, which stop() cancels (see _guarded).
        self._guarded_work: set[asyncio.Future[Any]] = set()
        self._stop_requested = threading.Event()
        self._pending_grace: float | None = None
        self._task_signal: Signal | None = None
        self._stop_reason = "stopped"
        #: Why the session ended by itself (for SignOff); a stop gives its own reason.
        self._end_reason = "runner exited"

    # ---- the public surface ----
    def run(self) -> None:
        """Runs the loop in this thread until the session is done or :meth:`stop` is called."""
        asyncio.run(self.run_async())

    async def run_async(self) -> None:
        """The loop itself, on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._stop_event = asyncio.Event()
        if self._stop_requested.is_set():
            self._begin_stop(self._pending_grace or 0.0)
        try:
            # The first job's discovery starts now: connecting and enrolling count against it.
            first = time.monotonic() + self.job_timeout
            await self._within(first, self.transport.open(), "connect and enrol")
            give_up: float | None = first
            while not self._stopping:
                job = await self._get_job(give_up)
                give_up = None
                if job is None:
                    return
                await self._do_job(job)
        except _Stopped:
            pass
        finally:
            await self._sign_off()
            await self.transport.close()
            _log.info("runner stopped", extra={"tasks": len(self.history)})

    def stop(self, grace: float = 0.0, reason: str = "stopped") -> None:
        """Stops the runner; safe from any thread and from signal handlers.

        Args:
            grace: Seconds the task in progress may take to finish and be reported before it is
                aborted and released. 0 aborts at once.
            reason: Put in the abort signal (executors see it in :class:`Aborted`).
        """
        self._stop_requested.set()
        self._pending_grace = grace
        self._stop_reason = reason
        loop = self._loop
        if loop is None or loop.is_closed():
            return  # run_async picks it up when it starts
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._begin_stop(grace)
        else:
            loop.call_soon_threadsafe(self._begin_stop, grace)

    # ---- stopping ----
    @property
    def _stopping(self) -> bool:
        return self._stop_requested.is_set()

    def _begin_stop(self, grace: float) -> None:
        assert self._loop is not None and self._stop_event is not None
        self._stop_event.set()
        for work in list(self._guarded_work):
            work.cancel()
        if grace <= 0:
            self._abort()
        else:
            self._loop.call_later(grace, self._abort)

    def _abort(self) -> None:
        reason = self._stop_reason
        self.abort_signal.trigger(reason)
        if self._task_signal is not None:
            self._task_signal.trigger(reason)

    async def _guarded(self, awaitable: Awaitable[_T]) -> _T:
        """Awaits ``awaitable`` unless stop() comes first (then cancels it and raises _Stopped)."""
        assert self._stop_event is not None
        work = asyncio.ensure_future(awaitable)
        if self._stop_event.is_set():
            work.cancel()
            raise _Stopped
        # stop() cancels what is in this set: no watcher task per call (10,000 simulated devices
        # make a call each, every round).
        self._guarded_work.add(work)
        try:
            # Cancelling this task cancels ``work`` too, and waits for it to unwind (and close its gRPC
            # call) before going on.
            return await work
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if work.cancelled() and not (current is not None and current.cancelling()):
                raise _Stopped from None  # cancelled by stop(), not by someone cancelling the runner
            raise
        finally:
            self._guarded_work.discard(work)

    async def _sleep(self, seconds: float) -> None:
        await self._guarded(asyncio.sleep(seconds))

    async def _sign_off(self) -> None:
        """Tells the coordinator that this device stops, so that it is not sampled until it is back.

        Best effort and bounded: a runner that cannot say so is counted offline after a while anyway.
        """
        reason = self._stop_reason if self._stopping else self._end_reason
        try:
            await asyncio.wait_for(self.transport.sign_off(reason), _SIGN_OFF_WAIT)
        except (FedlinkError, TimeoutError) as exc:
            _log.info(f"could not sign off: {exc or type(exc).__name__}")

    async def _within(self, deadline: float, awaitable: Awaitable[_T], what: str) -> _T:
        """Awaits ``awaitable`` (guarded); past ``deadline``, gives up if the coordinator is unreachable.

        A coordinator that answers slowly is waited for: only a transport that cannot connect ends the
        wait, with its cause.

        Raises:
            Unavailable: ``deadline`` passed while the transport could not reach the coordinator.
        """
        if math.isinf(deadline):
            return await self._guarded(awaitable)
        work = asyncio.ensure_future(self._guarded(awaitable))
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(work), max(deadline - time.monotonic(), 0))
                except TimeoutError:
                    if work.done():
                        return work.result()
                    problem = self.transport.connection_problem
                    if problem:
                        raise Unavailable(
                            f"could not {what} within the job timeout ({self.job_timeout:g}s): {problem}"
                        ) from None
                    deadline = time.monotonic() + _RECHECK_S
        finally:
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, _Stopped):
                    await work

    # ---- jobs ----
    async def _get_job(self, give_up: float | None = None) -> _Job | None:
        """GET_JOB: a job, or None when the session is over (DONE, or job_timeout spent).

        Args:
            give_up: When job discovery ends (monotonic seconds); default: ``job_timeout`` from now.
        """
        if give_up is None:
            give_up = time.monotonic() + self.job_timeout
        attempt = 0
        while True:
            offer = await self._within(
                give_up,
                self.transport.get_job(
                    job_name=self.job_name, device_info=self.device_info, user_info=self.user_info
                ),
                "get a job",
            )
            if offer.status is Status.OK:
                return self._start_job(offer.job_id, offer.job_name, offer.job_data)
            if offer.status is Status.DONE:
                _log.info("session done", extra={"job_name": self.job_name, "reason": offer.message})
                self._end_reason = "session done"
                return None
            if offer.status not in (Status.RETRY, Status.NO_JOB):
                raise InvalidArgument(f"GetJob answered {offer.status}, which it never should")
            if offer.status is Status.RETRY and offer.message and attempt == 0:
                _log.warning(f"no job yet: {offer.message}")  # e.g. the device awaits approval
            wait = self.backoff.after(offer.retry_after, attempt)
            attempt += 1
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                _log.info("no job within the job timeout", extra={"job_timeout_s": self.job_timeout})
                self._end_reason = "no job within the job timeout"
                return None
            # The last wait is cut short so that one more ask lands at the timeout itself.
            await self._sleep(min(wait, remaining))

    def _start_job(self, job_id: str, name: str, job_data: str) -> _Job:
        config: JobConfig | None = None
        error = ""
        try:
            config = process_job_data(
                job_data, self.resolver_registry, allow_components=self.allow_components
            )
        except FedlinkError as exc:
            # Every task of this job will be reported as failed with this message.
            error = f"job config: {type(exc).__name__}: {exc}"
            _log.error("the job's config is invalid", extra={"job_id": job_id, "error": error})
        ctx = job_context(config, self.data_source, self.partition, runner=self)
        _log.info("job started", extra={"job_id": job_id, "job_name": name})
        return _Job(job_id=job_id, name=name, job_data=job_data, config=config, config_error=error, ctx=ctx)

    async def _do_job(self, job: _Job) -> None:
        """GET_TASK / TASK / REPORT until the job has nothing more for this device."""
        while not self._stopping:
            offer = await self._guarded(self.transport.get_task(job_id=job.job_id, cookie=job.cookie))
            if offer.cookie:
                job.cookie = offer.cookie
            if offer.status is Status.OK:
                if not await self._do_task(job, offer):
                    return
            elif offer.status is Status.RETRY:
                await self._sleep(self.backoff.after(offer.retry_after))
            elif offer.status in (Status.NO_TASK, Status.DONE):
                _log.info("job over for this device", extra={"job_id": job.job_id, "status": offer.status})
                return
            else:
                raise InvalidArgument(f"GetTask answered {offer.status}, which it never should")

    # ---- one task ----
    async def _do_task(self, job: _Job, offer: TaskOffer) -> bool:
        """TASK and REPORT; returns False when the job is over (DONE)."""
        started = time.monotonic()
        if _log.isEnabledFor(logging.INFO):  # the message is built only if it is logged
            _log.info(
                f"task {offer.task_name} {offer.task_id} of job {job.job_id} received",
                extra={"job_id": job.job_id, "task_id": offer.task_id, "task_name": offer.task_name},
            )
        signal = Signal()
        self._task_signal = signal
        if self.abort_signal.triggered:
            signal.trigger(self.abort_signal.reason)
        renewer = _LeaseKeeper(self._keep_lease(job, offer, signal), _first_renewal(offer))
        try:
            # Not guarded by stop(): the executor runs on until the abort signal (stop after the grace
            # period, or a lost lease) ends it, so a finished result is never thrown away.
            outcome = await self._process(job, offer, signal)
        finally:
            renewer.cancel()
            self._task_signal = None
        if isinstance(outcome, Aborted):
            return await self._give_back(job, offer, started, str(outcome))
        result, error = outcome if isinstance(outcome, tuple) else (None, outcome)
        report = ResultReport(
            job_id=job.job_id, task_id=offer.task_id, cookie=offer.cookie, result=result, error_message=error
        )
        try:
            ack = await self.transport.report_result(report)
        except FedlinkError as exc:
            if isinstance(exc, Unavailable) and self.transport.connection_problem:
                raise  # unreachable for connect_timeout: the result waits on disk for the next start
            self._record(
                job, offer, "FAILED" if error else "SUCCEEDED", started, ack="REFUSED", error=str(exc)
            )
            _log.error(
                "the coordinator refused the report", extra={"task_id": offer.task_id, "error": str(exc)}
            )
            return True
        if ack.cookie:
            job.cookie = ack.cookie
        self._record(job, offer, "FAILED" if error else "SUCCEEDED", started, ack=ack.status, error=error)
        return ack.status is not Status.DONE

    async def _give_back(self, job: _Job, offer: TaskOffer, started: float, why: str) -> bool:
        ack = ""
        try:
            reply = await asyncio.wait_for(
                self.transport.release(
                    job_id=job.job_id, task_id=offer.task_id, cookie=offer.cookie, reason=why
                ),
                timeout=_ABORT_WAIT * 2,
            )
            ack = reply.status
        except (FedlinkError, TimeoutError) as exc:
            _log.warning("could not release the task", extra={"task_id": offer.task_id, "error": str(exc)})
        outcome = "RELEASED" if self._stopping else "ABANDONED"
        self._record(job, offer, outcome, started, ack=ack, error=why)
        return True

    def _record(
        self, job: _Job, offer: TaskOffer, outcome: str, started: float, *, ack: str, error: str = ""
    ) -> None:
        record = TaskRecord(
            job_id=job.job_id,
            task_id=offer.task_id,
            task_name=offer.task_name,
            outcome=outcome,
            duration_s=round(time.monotonic() - started, 3),
            ack=str(ack),
            error=error,
        )
        self.history.append(record)
        if not _log.isEnabledFor(logging.INFO):
            return
        _log.info(
            f"task {record.task_name} {record.task_id} of job {record.job_id}: {record.outcome} in "
            f"{record.duration_s:.3f}s (ack {record.ack or '-'})" + (f": {error}" if error else ""),
            extra={
                "job_id": record.job_id,
                "task_id": record.task_id,
                "task_name": record.task_name,
                "outcome": record.outcome,
                "duration_s": record.duration_s,
                "ack": record.ack,
                **({"error": error} if error else {}),
            },
        )

    async def _keep_lease(self, job: _Job, offer: TaskOffer, signal: Signal) -> None:
        """Renews the lease every third of its length while the task runs; aborts it if lost.

        Started (by :class:`_LeaseKeeper`) when the first renewal is due: it renews at once."""
        expires = offer.lease_expires_at
        failures = 0
        last_error = ""
        while expires is not None:
            try:
                reply = await self.transport.renew_lease(
                    job_id=job.job_id, task_id=offer.task_id, cookie=offer.cookie
                )
            except FedlinkError as exc:
                # A fault the transport does not retry (revoked, refused, the coordinator unreachable for
                # connect_timeout): try again after a backoff, never in a tight loop.
                delay = self.backoff.delay(failures)
                failures += 1
                error = f"{type(exc).__name__}: {exc}"
                level = logging.WARNING if error != last_error else logging.DEBUG
                last_error = error
                _log.log(
                    level,
                    f"lease renewal of task {offer.task_id} failed ({error}); "
                    f"retry {failures} in {delay:.3f}s",
                    extra={
                        "job_id": job.job_id,
                        "task_id": offer.task_id,
                        "error": error,
                        "attempt": failures,
                    },
                )
                await asyncio.sleep(delay)
                continue
            failures, last_error = 0, ""
            if reply.status is not Status.OK or reply.lease_expires_at is None:
                signal.trigger(f"lease lost ({reply.status})")
                return
            expires = reply.lease_expires_at
            await asyncio.sleep(_renewal_delay(expires))

    async def _process(self, job: _Job, offer: TaskOffer, signal: Signal) -> tuple[DXO, str] | str | Aborted:
        """TASK, on the worker: the result and "", or the failure message, or Aborted."""
        work = TaskWork(
            job_id=job.job_id,
            job_data=job.job_data,
            task_id=offer.task_id,
            task_name=offer.task_name,
            task_data=offer.task_data,
            partition=self.partition,
            app_in_filters=self.app_in_filters,
            app_out_filters=self.app_out_filters,
            signal=signal,
            _run_here=lambda: self._execute(job, offer, signal),
        )
        try:
            return _as_dxo(await self.worker.run(work), f"worker {type(self.worker).__name__}"), ""
        except Aborted as exc:
            return exc
        except _ConfigRefused as exc:
            return str(exc)  # already "job config: <error type>: <message>"
        except Exception as exc:  # any bug in user code becomes a failed result, never a dead daemon
            return f"{type(exc).__name__}: {exc}"

    def _execute(self, job: _Job, offer: TaskOffer, signal: Signal) -> DXO:
        if job.config is None:
            raise _ConfigRefused(job.config_error)
        return execute_task(
            job.config,
            job.ctx,
            task_id=offer.task_id,
            task_name=offer.task_name,
            task_data=offer.task_data,
            app_in_filters=self.app_in_filters,
            app_out_filters=self.app_out_filters,
            signal=signal,
        )


class _ConfigRefused(Exception):
    """A task of a job whose config this device refused; its message is the whole report."""


def job_context(
    config: JobConfig | None,
    data_source: DataSource | None,
    partition: tuple[int, int] | None,
    *,
    runner: Runner | None = None,
) -> Context:
    """The context every task of a job starts from (runner, data source, partition, components)."""
    ctx = Context()
    ctx[ContextKey.RUNNER] = runner
    ctx[ContextKey.DATA_SOURCE] = data_source
    if partition is not None:
        ctx[ContextKey.PARTITION_ID], ctx[ContextKey.NUM_PARTITIONS] = partition
    if config is not None:
        ctx[ContextKey.COMPONENTS] = dict(config.components)
        ctx[ContextKey.EVENT_HANDLERS] = list(config.handlers)
    return ctx


def execute_task(
    config: JobConfig,
    job_ctx: Context,
    *,
    task_id: str,
    task_name: str,
    task_data: DXO | None,
    app_in_filters: Sequence[Filter],
    app_out_filters: Sequence[Filter],
    signal: Signal,
) -> DXO:
    """One task: app then job in-filters → ``BEFORE_TRAIN`` → executor → ``AFTER_TRAIN`` → out-filters.

    Runs in the calling thread, on a copy of ``job_ctx`` (see :func:`job_context`).

    Raises:
        Aborted: ``signal`` was triggered (checked between every step).
        InvalidArgument: no input data, no executor for the task, or a step returned no valid DXO.
    """
    if task_data is None:
        raise InvalidArgument(f"task {task_name!r} came without input data")
    executor = config.executor_for(task_name)
    ctx = job_ctx.copy()
    ctx[ContextKey.TASK_ID] = task_id
    ctx[ContextKey.TASK_NAME] = task_name
    ctx[ContextKey.TASK_DATA] = task_data
    ctx[ContextKey.EXECUTOR] = executor
    signal.check()
    dxo = _apply(task_data, [*app_in_filters, *config.in_filters], "in", ctx, signal)
    signal.check()
    ctx.fire_event(EventType.BEFORE_TRAIN, time.time())
    output = _as_dxo(executor.execute(dxo, ctx, signal), f"executor {type(executor).__name__}")
    signal.check()
    ctx.fire_event(EventType.AFTER_TRAIN, (time.time(), output))
    output = _apply(output, [*app_out_filters, *config.out_filters], "out", ctx, signal)
    signal.check()
    output.validate()
    return output


def _apply(dxo: DXO, filters: Sequence[Filter], kind: str, ctx: Context, signal: Signal) -> DXO:
    for index, item in enumerate(filters):
        dxo = _as_dxo(item.filter(dxo, ctx, signal), f"{kind}-filter #{index} ({type(item).__name__})")
        signal.check()
    return dxo


def _as_dxo(value: object, what: str) -> DXO:
    if not isinstance(value, DXO):
        raise InvalidArgument(f"{what} returned {type(value).__name__}, not a DXO")
    return value


def _renewal_delay(expires: datetime) -> float:
    """Seconds until a lease that ends at ``expires`` is renewed: a third of what is left of it."""
    return max((expires - datetime.now(UTC)).total_seconds() / 3, 0.05)


def _first_renewal(offer: TaskOffer) -> float | None:
    return None if offer.lease_expires_at is None else _renewal_delay(offer.lease_expires_at)


class _LeaseKeeper:
    """Runs a task's lease renewals from when the first one is due.

    A timer until then, not a task: most tasks end before their first renewal, and a task per task
    (created, scheduled, then cancelled) had cost a simulation of 10,000 devices ~2 % of its loop.
    """

    def __init__(self, renewals: Coroutine[Any, Any, None], delay: float | None) -> None:
        self._renewals = renewals
        self._task: asyncio.Task[None] | None = None
        self._timer = None if delay is None else asyncio.get_running_loop().call_later(delay, self._start)

    def _start(self) -> None:
        self._timer = None
        self._task = asyncio.get_running_loop().create_task(self._renewals)

    def cancel(self) -> None:
        """Stops the renewals (or never starts them)."""
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()
        else:
            self._renewals.close()  # never awaited: closed, without a "never awaited" warning
