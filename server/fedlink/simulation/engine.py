"""Runs a simulation: the real coordinator core, and one real Runner loop per virtual device.

The order of a run: open a coordinator core on an in-memory (or file) SQLite store; enrol the N
virtual devices; submit the job exactly as an operator would (initial model as a blob, then
``submit_job``); start one Runner per device over the in-process transport, its task work given to
the backend's pool (the Runner's ``worker=``); follow the job's events until it is final; collect the
result from the store; stop the Runners and the core. Nothing of the workflow, the store or the
Runner is re-implemented.

With ``transport="grpc"`` the core is the real :class:`~fedlink.server.app.Coordinator`, serving
plaintext gRPC on ``127.0.0.1:0``, and every device's Runner uses a
:class:`~fedlink.runner.transport.grpc_transport.GrpcTransport` (state directory per device in the
run's temporary directory), so every GetJob, GetTask, ReportResult and blob transfer goes over the
wire. The devices are enrolled in the store beforehand (their identity files are written for them),
so that their ids — and with them sampling and aggregation order — are those of an in-process run.
Heterogeneity needs the in-process transport, and the live device counts stay zero over gRPC.
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import math
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from fedlink.common.dxo import DXO
from fedlink.common.errors import InvalidArgument
from fedlink.runner.builtins import BUILTIN_TYPES
from fedlink.runner.config import (
    ResolverRegistry,
    is_import_path,
    load_component_type,
    outline_job_data,
)
from fedlink.runner.loop import Runner
from fedlink.runner.spec import DataSource, Executor
from fedlink.runner.transport.backoff import Backoff
from fedlink.runner.transport.base import Transport
from fedlink.runner.transport.grpc_transport import GrpcTransport, GrpcTransportConfig
from fedlink.runner.transport.state import Identity, StateDir
from fedlink.runner.validation import BUILTIN_PATH_ARGS, check_job_data
from fedlink.server.app import Coordinator
from fedlink.server.core import CoordinatorCore
from fedlink.server.domain import JobEvent, JobState, ResultStatus, WorkflowSpec, is_final
from fedlink.server.gc_tuning import GC_CONTROL
from fedlink.server.protocol.control import JobSubmission
from fedlink.server.protocol.events import JOB_STATE_CHANGED
from fedlink.server.settings import CoordinatorSettings
from fedlink.server.workflows import registry as workflows
from fedlink.simulation.backends import ExecutorPool
from fedlink.simulation.clock import LoopClock, ScaledEventLoop
from fedlink.simulation.components import shared_registry
from fedlink.simulation.heterogeneity import Heterogeneity
from fedlink.simulation.job import SimulationJob
from fedlink.simulation.progress import ProgressSink, TrackingProgress
from fedlink.simulation.result import Failure, RoundRecord, SimulationError, SimulationResult
from fedlink.simulation.transport import DeviceHub, InProcessTransport, LiveCounts

log = logging.getLogger(__name__)

#: The component type an ``Executor`` given as ``runner=`` is registered under.
EXECUTOR_TYPE = "SimulationExecutor"
#: Idle devices hold one long poll this long; every real wake-up comes from a notification, so a long
#: wait costs nothing and keeps 10,000 idle devices from re-polling the store. Longer than any round:
#: a device whose poll ended (RETRY, then its runner's pause) when the next round's tasks came claimed
#: behind every device woken at once; at 100,000 devices its result then came ~40,000th, and the
#: round's fold, which takes results in device order, held its budget's worth and sent the other
#: ~90,000 through the store (rounds 2 and 3 twice as long as round 1).
_TASK_WAIT = timedelta(hours=1)
#: How long stopped Runners get to wind down (release their task) before they are cancelled.
_STOP_WAIT_S = 10.0
_TICK_S = 0.25
#: How often the workflow re-reads a round's state (see :func:`round_check_seconds`).
_ROUND_CHECK_MIN_S = 0.05
_ROUND_CHECK_MAX_S = 0.5
_ROUND_CHECK_PER_DEVICE_S = 1e-4
#: Bytes of results in flight the in-process transport aims for (see :func:`in_flight_limit`).
_IN_FLIGHT_BYTES = 256 * 1024**2
#: Results in flight at most, however small the model (more gains nothing: the coordinator batches
#: at most 256 reports per transaction).
_MAX_IN_FLIGHT = 1024
_SUPERVISOR_LOGGER = "fedlink.server.services.supervisor"

RunnerArg = Mapping[str, Any] | str | ResolverRegistry | Executor | None
#: How the virtual devices reach the coordinator.
TRANSPORTS = ("inprocess", "grpc")
#: The modules a simulation's job may import its component types from: any. The simulation runs the
#: user's own job on the user's own machine, in the user's process: nothing is received from anyone.
ALLOW_COMPONENTS = ("*",)


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Everything a run needs, checked before anything starts."""

    job: SimulationJob
    num_devices: int
    job_data: str
    registry: ResolverRegistry | None
    data: DataSource | None
    device_info: Mapping[str, str]
    heterogeneity: Heterogeneity
    seed: int
    #: ":memory:" (a throwaway store in a temporary directory, removed at the end) or the path of a
    #: new SQLite file to inspect later.
    store: str | Path
    timeout_s: float
    #: "inprocess" or "grpc" (see the module docstring).
    transport: str = "inprocess"
    sinks: Sequence[ProgressSink] = field(default=())
    #: The app's own type names (its registry's), which the coordinator accepts in job_data.
    component_types: tuple[str, ...] = ()


def make_plan(
    job: SimulationJob,
    num_devices: int,
    *,
    runner: RunnerArg,
    data: DataSource | None,
    device_info: Mapping[str, str] | None,
    heterogeneity: Heterogeneity | None,
    seed: int | None,
    store: str | Path,
    timeout: float | None,
    share_components: bool,
    sinks: Sequence[ProgressSink],
    transport: str = "inprocess",
) -> Plan:
    """Checks the arguments of a simulation and resolves ``runner=`` into job_data and a registry.

    Raises:
        InvalidArgument: naming the argument that is wrong.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise InvalidArgument(f"num_devices must be an integer >= 1, not {num_devices!r}")
    if not isinstance(job, SimulationJob):
        raise InvalidArgument(f"job must be a SimulationJob (or a job file path), not {type(job).__name__}")
    job = job.with_seed(seed)
    job.model_dxo()  # checked now, not after the devices are enrolled
    job_data, app = _runner_config(job, runner)
    app = _with_import_paths(job_data, app)
    check_job_data(
        job_data,
        task_names=workflows.task_names(job.spec),
        known_types=[glob.escape(name) for name in app or ()],
        workflow=f"the {job.spec.name} workflow",
    )
    _check_files(job_data)
    if data is None and job.simulation is not None:
        device_data = job.simulation.device_data()
        data = None if device_data is None else device_data.partitioned()  # device i: partition i
    if store != ":memory:" and Path(store).exists():
        raise InvalidArgument(f"store file {store} exists already: give a new path (or ':memory:')")
    params = job.params()  # checked now, not after the devices are enrolled
    if timeout is None:
        bound = None if params is None else params.time_bound_s()
        timeout = math.inf if bound is None else bound + 60.0
    if not (isinstance(timeout, int | float) and timeout > 0):
        raise InvalidArgument(f"timeout must be a positive number of seconds, not {timeout!r}")
    if heterogeneity is None and job.simulation is not None and job.simulation.heterogeneity is not None:
        heterogeneity = Heterogeneity.from_table(job.simulation.heterogeneity)  # the argument comes first
    hetero = heterogeneity or Heterogeneity()
    if transport not in TRANSPORTS:
        raise InvalidArgument(f"unknown transport {transport!r}; available: {', '.join(TRANSPORTS)}")
    if transport == "grpc" and hetero != Heterogeneity():
        raise InvalidArgument("heterogeneity needs transport='inprocess' (it is applied by that transport)")
    return Plan(
        job=job,
        num_devices=num_devices,
        job_data=job_data,
        registry=shared_registry(app) if share_components else app,
        data=data,
        device_info={"simulation": "true", **dict(device_info or {})},
        heterogeneity=hetero,
        seed=_job_seed(job.spec),
        store=store,
        timeout_s=float(timeout),
        transport=transport,
        sinks=tuple(sinks),
        component_types=tuple(glob.escape(name) for name in app or ()),
    )


def _runner_config(job: SimulationJob, runner: RunnerArg) -> tuple[str, ResolverRegistry | None]:
    """The job_data the devices run, and the app's registry, from the job and ``runner=``."""
    job_data = job.job_data_json()
    app: ResolverRegistry | None = None
    if isinstance(runner, ResolverRegistry):
        app = runner
    elif isinstance(runner, Mapping | str):
        job_data = SimulationJob(
            name=job.name, workflow=job.workflow, model={}, job_data=runner
        ).job_data_json()
    elif runner is not None:
        if not isinstance(runner, Executor):
            raise InvalidArgument(
                "runner must be job_data (a mapping or JSON text), a ResolverRegistry or an Executor "
                f"(an object with execute(dxo, ctx, abort_signal)), not {type(runner).__name__}"
            )
        if job_data:
            raise InvalidArgument("give the executor as runner= or job_data in the job, not both")
        executor = runner
        app = ResolverRegistry({EXECUTOR_TYPE: lambda: executor})
        job_data = json.dumps(
            {"components": [{"type": EXECUTOR_TYPE, "name": "trainer"}], "executors": {"*": "@trainer"}}
        )
    if not job_data:
        raise InvalidArgument(
            "the job has no job_data: give the runner configuration or an Executor as runner="
        )
    return job_data, app


def _with_import_paths(job_data: str, app: ResolverRegistry | None) -> ResolverRegistry | None:
    """``app`` plus the import-path types ``job_data`` names that it lacks, imported now (any module:
    see :data:`ALLOW_COMPONENTS`), so that they are shared like the app's (and reach a Ray pool)."""
    outline = outline_job_data(job_data)
    wanted = [
        spec.type
        for spec in outline.components
        if is_import_path(spec.type)
        and spec.type not in BUILTIN_TYPES
        and (app is None or spec.type not in app)
    ]
    if not wanted:
        return app
    extended = ResolverRegistry().merged(app)
    for type_name in dict.fromkeys(wanted):
        extended.register(type_name, load_component_type(type_name, ALLOW_COMPONENTS))
    return extended


def _check_files(job_data: str) -> None:
    """Every file a built-in data source of ``job_data`` reads is here: the devices are this machine."""
    for spec in outline_job_data(job_data).components:
        for arg in BUILTIN_PATH_ARGS.get(spec.type, ()):
            value = spec.args.get(arg)
            if isinstance(value, str) and value and not value.startswith("@") and not Path(value).exists():
                raise InvalidArgument(
                    f"job_data component {spec.name!r} ({spec.type}) args.{arg}: file {value} does not exist"
                )


def _job_seed(spec: WorkflowSpec) -> int:
    """The workflow's sampling seed, which also seeds the heterogeneity draws (0 if it has none)."""
    seed = spec.config.get("seed", 0)
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else 0


class _WorkflowErrors(logging.Handler):
    """Keeps the exceptions the job supervisor logs, so the caller gets the original one."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.by_job: dict[str, BaseException] = {}

    def emit(self, record: logging.LogRecord) -> None:
        # The supervisor logs log.exception("workflow of job %s failed", job_id).
        if (
            record.exc_info
            and record.exc_info[1] is not None
            and isinstance(record.args, tuple)
            and record.args
        ):
            self.by_job[str(record.args[0])] = record.exc_info[1]


def _settings(plan: Plan, workdir: Path) -> CoordinatorSettings:
    if plan.store == ":memory:":
        # A throwaway SQLite file in the run's temporary directory rather than SQLite's :memory:,
        # whose single shared connection serialises every read and is lost if a call is cancelled.
        url, blob_dir = f"sqlite+aiosqlite:///{workdir / 'simulation.db'}", workdir / "blobs"
    else:
        path = Path(plan.store).resolve()
        url, blob_dir = f"sqlite+aiosqlite:///{path}", Path(f"{path}.blobs")
    common: dict[str, Any] = {
        "data_dir": workdir,
        "db_url": url,
        "blob_dir": blob_dir,
        "max_task_wait": _TASK_WAIT,
        "default_task_wait": _TASK_WAIT,
        "reaper_interval": timedelta(seconds=0.5),
        "auto_migrate": True,
        # The simulation runs in the user's own process: a workflow of their own needs no allowing.
        "allow_workflows": ("*",),
        "component_types": plan.component_types,
    }
    if plan.transport == "grpc":
        # The wire's own limits (large models go as blob streams), on loopback, without TLS.
        return CoordinatorSettings(
            **common,
            listen_address="127.0.0.1:0",
            insecure=True,
            open_enrolment=True,
            shutdown_grace=timedelta(seconds=1),
        )
    big = 2 * 1024**3  # models travel inline: there is no message to keep small in-process
    return CoordinatorSettings(**common, max_message_bytes=big, inline_payload_bytes=big)


async def simulate(plan: Plan, pool: ExecutorPool) -> SimulationResult:
    """Runs ``plan`` on the running event loop (which this function may configure: it owns it)."""
    started = time.perf_counter()
    errors = _WorkflowErrors()
    supervisor_log = logging.getLogger(_SUPERVISOR_LOGGER)
    supervisor_log.addHandler(errors)
    workdir = Path(tempfile.mkdtemp(prefix="fedlink-sim-"))
    try:
        with GC_CONTROL.quiet():
            if plan.transport == "grpc":
                async with Coordinator(_settings(plan, workdir)) as coordinator:
                    assert coordinator.core is not None and coordinator.endpoint is not None
                    wire = (coordinator.endpoint.address, workdir / "devices")
                    return await _run(plan, coordinator.core, pool, errors, started, wire)
            checks = round_check_seconds(plan.num_devices)
            loop = asyncio.get_running_loop()
            async with CoordinatorCore(
                _settings(plan, workdir),
                # A scaled loop's time for the store too: leases and deadlines run as its timers do.
                clock=LoopClock(loop) if isinstance(loop, ScaledEventLoop) else None,
                supervisor_poll_seconds=0.05,
                round_check_seconds=checks,
                keep_folded_payloads=plan.store != ":memory:",  # a throwaway store keeps metadata
            ) as core:
                return await _run(plan, core, pool, errors, started, None)
    finally:
        supervisor_log.removeHandler(errors)
        for sink in plan.sinks:
            sink.close()
        remove_in_background(workdir)


def remove_in_background(path: Path) -> threading.Thread:
    """Removes a run's scratch directory (its store and blobs) in a thread, so the result is not
    held back by the file system deleting thousands of result blobs (seconds at 1,000 devices).

    The thread is not a daemon: the interpreter waits for it at exit, so nothing is left behind.
    """
    thread = threading.Thread(
        target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True}, name="fedlink-sim-cleanup"
    )
    thread.start()
    return thread


def round_check_seconds(num_devices: int) -> float:
    """The least time between two reads of a round's state by the workflow (FedAvg's round summary).

    A summary reads every task of the round: at 10,000 devices, re-read every 50 ms (the workflow's
    default), it would keep the event loop busy all round. 0.1 ms per device keeps it to about a tenth
    of the loop, at a cost of at most that much latency when the round's last result arrives.
    """
    return min(_ROUND_CHECK_MAX_S, max(_ROUND_CHECK_MIN_S, num_devices * _ROUND_CHECK_PER_DEVICE_S))


def in_flight_limit(model_bytes: int, workers: int) -> int:
    """How many results the virtual devices may have in flight at once (work started, report unanswered).

    About ``_IN_FLIGHT_BYTES`` of results (a result is the size of the model), so that 1,000 devices
    of a 1,000,000-float model do not hold 1,000 results of 4 MB at once; never fewer than twice the
    pool's workers (they must not idle), never more than ``_MAX_IN_FLIGHT``.
    """
    by_bytes = _IN_FLIGHT_BYTES // max(1, model_bytes)
    return max(2 * workers, min(_MAX_IN_FLIGHT, by_bytes), 1)


def _grpc_transports(
    devices: Sequence[InProcessTransport], credentials: Sequence[str], address: str, state_root: Path
) -> list[Transport]:
    """One GrpcTransport per enrolled device, its identity file written as if it had enrolled itself."""
    transports: list[Transport] = []
    for device, credential in zip(devices, credentials, strict=True):
        state_dir = state_root / f"device-{device.index}"
        StateDir(state_dir).save_identity(
            Identity(
                enroll_request_id=f"simulation-{device.index}",
                device_id=device.device_id,
                credential=credential,
                server=address,
            )
        )
        config = GrpcTransportConfig(
            server=address,
            state_dir=state_dir,
            insecure=True,
            backoff=Backoff(base=timedelta(milliseconds=50), cap=timedelta(seconds=2)),
        )
        transports.append(GrpcTransport(config))
    return transports


async def _run(
    plan: Plan,
    core: CoordinatorCore,
    pool: ExecutorPool,
    errors: _WorkflowErrors,
    started: float,
    wire: tuple[str, Path] | None,
) -> SimulationResult:
    job = plan.job
    model_bytes = job.model_dxo().to_bytes()
    hub = DeviceHub(
        core,
        heterogeneity=plan.heterogeneity,
        seed=plan.seed,
        max_in_flight=in_flight_limit(len(model_bytes), pool.size),
    )
    width = max(6, len(str(plan.num_devices - 1)))
    devices = [InProcessTransport(hub, i) for i in range(plan.num_devices)]
    info = dict(plan.device_info)
    credentials = await hub.enroll(devices, info, width=width, job_name=job.name)
    index_of = {t.device_id: t.index for t in devices}
    transports: list[Transport] = list(devices)
    if wire is not None:
        transports = _grpc_transports(devices, credentials, *wire)
    model_ref = await core.store.blobs.put_bytes(model_bytes)
    del model_bytes
    view = await core.control_protocol.submit_job(
        JobSubmission(
            name=job.name,
            workflow=job.spec,
            job_data=plan.job_data,
            initial_model_sha256=model_ref.sha256,
            device_selector=dict(job.device_selector),
        ),
        request_id="",
    )
    job_id = view.job.job_id
    for sink in plan.sinks:
        if isinstance(sink, TrackingProgress):
            sink.job_submitted(job_id)
    setup_s = time.perf_counter() - started
    runners = [
        Runner(
            job.name,
            plan.data,
            info,
            {},
            math.inf,
            resolver_registry=plan.registry,
            allow_components=ALLOW_COMPONENTS,
            transport=t,
            partition_id=i,
            num_partitions=plan.num_devices,
            backoff=Backoff(base=timedelta(milliseconds=50), cap=timedelta(seconds=2)),
            worker=t.gated(pool.worker) if isinstance(t, InProcessTransport) else pool.worker,
        )
        for i, t in enumerate(transports)
    ]
    tasks = [asyncio.create_task(r.run_async(), name=f"device-{i}") for i, r in enumerate(runners)]
    GC_CONTROL.settle(generation=1)
    ticker = asyncio.create_task(_tick(plan.sinks, hub.counts))
    try:
        try:
            async with asyncio.timeout(None if math.isinf(plan.timeout_s) else plan.timeout_s):
                rounds = await _follow(core, job_id, plan.sinks)
            # The job is over: every device told DONE would ask for another job (100,000 GetJob calls
            # that held the result's reads back by seconds). Stopped now, its calls end; they are
            # cancelled only after the result is read (_stop).
            _tell_stop(runners)
        except TimeoutError:
            await core.control_protocol.abort_job(job_id, "simulation timed out")
            raise SimulationError(
                f"the simulation did not finish within its timeout of {plan.timeout_s:.0f}s"
            ) from None
        final = (await core.control_protocol.describe_job(job_id)).job
        if final.state is not JobState.FINISHED:
            raise SimulationError(
                f"the job ended {final.state.value}: {final.message or 'no message'}",
                job_state=final.state.value,
                rounds_done=len(rounds),
            ) from errors.by_job.get(job_id)
        # Collected before the Runners are stopped: stopping cancels calls that may be in the store.
        return await _collect(core, job_id, plan, rounds, index_of, hub.counts, setup_s, started)
    finally:
        ticker.cancel()
        await _stop(runners, tasks)
        if plan.sinks:
            _emit_tick(plan.sinks, hub.counts)


async def _follow(core: CoordinatorCore, job_id: str, sinks: Sequence[ProgressSink]) -> list[RoundRecord]:
    """Follows the job's events until it is final; returns the closed rounds."""
    starts: dict[int, tuple[JobEvent, int]] = {}
    rounds: list[RoundRecord] = []
    origin: JobEvent | None = None
    async for event in core.control_protocol.watch_job(job_id, after_sequence=0):
        origin = origin or event
        body = json.loads(event.payload_json)
        if event.kind == "round_started":
            starts[body["round"]] = (event, int(body.get("num_devices", 0)))
            for sink in sinks:
                sink.round_started(body["round"], int(body.get("num_devices", 0)))
        elif event.kind == "round_closed":
            begun, sampled = starts.get(body["round"], (event, 0))
            record = RoundRecord(
                round=int(body["round"]),
                num_devices=sampled,
                num_results=int(body.get("num_results", 0)),
                metrics={str(k): float(v) for k, v in dict(body.get("metrics", {})).items()},
                duration_s=(event.time - begun.time).total_seconds(),
                virtual_time_s=(event.time - origin.time).total_seconds(),
            )
            rounds.append(record)
            GC_CONTROL.settle()
            for sink in sinks:
                sink.round_closed(record)
        elif event.kind == "model_version":  # FedBuff: a version is a round's record, timed from the last
            begun, _ = starts.get(-1, (event, 0))
            starts[-1] = (event, 0)
            record = RoundRecord(
                round=int(body["round"]),
                num_devices=int(body.get("selection", 0)),
                num_results=int(body.get("num_updates", 0)),
                metrics={str(k): float(v) for k, v in dict(body.get("metrics", {})).items()},
                duration_s=(event.time - begun.time).total_seconds(),
                virtual_time_s=(event.time - origin.time).total_seconds(),
            )
            rounds.append(record)
            GC_CONTROL.settle()
            for sink in sinks:
                sink.round_closed(record)
        elif event.kind == JOB_STATE_CHANGED:
            log.debug("job state", extra={"job_id": job_id, "state": body.get("state")})
            if is_final(JobState(body["state"])):
                for sink in sinks:
                    if isinstance(sink, TrackingProgress):
                        sink.job_ended(str(body["state"]))
            starts.setdefault(-1, (event, 0))  # the first version is timed from the job's start
    return rounds


def _emit_tick(sinks: Sequence[ProgressSink], counts: LiveCounts) -> None:
    for sink in sinks:
        sink.tick(counts)


async def _tick(sinks: Sequence[ProgressSink], counts: LiveCounts) -> None:
    if not sinks:
        return
    while True:
        _emit_tick(sinks, counts)
        await asyncio.sleep(_TICK_S)


def _tell_stop(runners: Sequence[Runner]) -> None:
    for runner in runners:
        runner.stop(grace=0.0, reason="simulation over")  # the job is over: a late result would be stale


async def _stop(runners: Sequence[Runner], tasks: Sequence[asyncio.Task[None]]) -> None:
    """Stops every Runner (a task in progress is aborted and released), then cancels what is left."""
    _tell_stop(runners)
    done, pending = await asyncio.wait(tasks, timeout=_STOP_WAIT_S) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            log.error("a virtual device's runner crashed", exc_info=task.exception())


async def _collect(
    core: CoordinatorCore,
    job_id: str,
    plan: Plan,
    rounds: list[RoundRecord],
    index_of: Mapping[str, int],
    counts: LiveCounts,
    setup_s: float,
    started: float,
) -> SimulationResult:
    store = core.store
    run = await store.get_current_run(job_id)
    if run.global_model_sha256 is None:  # pragma: no cover - a FINISHED run always has a model
        raise SimulationError("the job finished without a model")
    model = DXO.from_bytes(await store.blobs.read(run.global_model_sha256))
    participation: dict[int, list[int]] = {i: [] for i in range(plan.num_devices)}
    failures: list[Failure] = []
    for result in await store.result_outlines(run.run_id):
        device = index_of.get(result.device_id, -1)
        if result.status is ResultStatus.FAILED:
            failures.append(
                Failure(
                    device=device, round=result.round, task_name=result.task_name, cause=result.error_message
                )
            )
        elif result.accepted and result.task_name == "train":
            participation[device].append(result.round)
    for rounds_in in participation.values():
        rounds_in.sort()
    failures.sort(key=lambda f: (f.round, f.device, f.task_name))
    return SimulationResult(
        model=model,
        rounds=tuple(rounds),
        participation={i: tuple(r) for i, r in participation.items()},
        failures=tuple(failures),
        dropouts=tuple(counts.drops),
        vanished=tuple(counts.gone),
        num_devices=plan.num_devices,
        job_id=job_id,
        store_url="" if plan.store == ":memory:" else core.settings.db_url,
        setup_s=setup_s,
        wall_time_s=time.perf_counter() - started,
    )
