"""``run_simulation`` and ``run_simulation_async``: the public entry points of the simulation.

A simulation always runs on an event loop of its own (it sets that loop's default executor to the
backend's pool, and it must not be starved by, or starve, the caller's loop). Called from plain code,
``run_simulation`` runs it in the calling thread; called where an event loop is already running (a
notebook cell, an async test), it runs it in a fresh thread and waits. Ctrl-C stops the devices and
the coordinator core cleanly, then raises ``KeyboardInterrupt``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from fedlink.runner.spec import DataSource
from fedlink.server.tracking import TrackingConfig, build_sinks
from fedlink.server.workflows import registry
from fedlink.simulation.backends import check_backend, create_pool
from fedlink.simulation.clock import ScaledEventLoop, check_time_scale
from fedlink.simulation.engine import Plan, RunnerArg, make_plan, simulate
from fedlink.simulation.heterogeneity import Heterogeneity
from fedlink.simulation.job import SimulationJob
from fedlink.simulation.progress import MetricsFile, ProgressLine, ProgressSink, TrackingProgress
from fedlink.simulation.result import SimulationResult

__all__ = ["run_simulation", "run_simulation_async"]

_T = TypeVar("_T")


def _loop_factory(time_scale: float = 1.0) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if time_scale != 1.0:  # uvloop's timers cannot be scaled: asyncio's selector loop can
        return lambda: ScaledEventLoop(time_scale)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop comes with the server extra on Linux and macOS
        return None
    return uvloop.new_event_loop


def _run_here(make: Callable[[], Coroutine[Any, Any, _T]], time_scale: float = 1.0) -> _T:
    # asyncio.Runner turns Ctrl-C into a cancellation of the main task (so cleanup runs), then re-raises.
    with asyncio.Runner(loop_factory=_loop_factory(time_scale)) as runner:
        return runner.run(make())


class _Thread:
    """Runs a coroutine on a fresh event loop in a thread of its own; can be cancelled from outside."""

    def __init__(self, make: Callable[[], Coroutine[Any, Any, _T]], time_scale: float = 1.0) -> None:
        self._time_scale = time_scale
        self.future: Future[Any] = Future()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(
            target=self._main, args=(make,), name="fedlink-simulation", daemon=True
        )
        self._thread.start()
        self._ready.wait()

    def _main(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        async def body() -> Any:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            self._ready.set()
            return await make()

        try:
            with asyncio.Runner(loop_factory=_loop_factory(self._time_scale)) as runner:
                result = runner.run(body())
        except BaseException as exc:  # handed to the waiting thread, which re-raises it
            if not self.future.done():
                self.future.set_exception(exc)
        else:
            if not self.future.done():
                self.future.set_result(result)
        finally:
            self._ready.set()

    def cancel(self) -> None:
        """Cancels the simulation (it cleans up, then the future holds CancelledError)."""
        loop, task = self._loop, self._task
        if loop is not None and task is not None and not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)

    def join(self) -> None:
        """Waits for the thread, cancelling the simulation on Ctrl-C (then re-raising it)."""
        try:
            while self._thread.is_alive():
                self._thread.join(0.2)
        except KeyboardInterrupt:
            self.cancel()
            self._thread.join()
            raise


def _prepare(
    job: SimulationJob | str | Path,
    num_devices: int,
    *,
    runner: RunnerArg,
    backend: str,
    backend_config: Mapping[str, object] | None,
    seed: int | None,
    data: DataSource | None,
    heterogeneity: Heterogeneity | None,
    device_info: Mapping[str, str] | None,
    store: str | Path,
    progress: bool | ProgressSink,
    metrics_jsonl: str | Path | None,
    tracking: TrackingConfig | None,
    timeout: float | None,
    share_components: bool,
    transport: str,
    time_scale: float,
) -> Callable[[], Coroutine[Any, Any, SimulationResult]]:
    """Checks everything that can be checked before a loop or a thread exists; returns the run."""
    check_time_scale(time_scale)
    if isinstance(job, str | Path):
        job = SimulationJob.from_file(job)
    if tracking is None:
        tracking = job.tracking
    backend_spec = check_backend(backend, backend_config)  # checked now; the pool starts in the run
    sinks: list[ProgressSink] = []
    plan: Plan = make_plan(
        job,
        num_devices,
        runner=runner,
        data=data,
        device_info=device_info,
        heterogeneity=heterogeneity,
        seed=seed,
        store=store,
        timeout=timeout,
        share_components=share_components,
        sinks=sinks,
        transport=transport,
    )
    if progress is True:
        sinks.append(ProgressLine(registry.num_steps(plan.job.spec), num_devices))
    elif progress is not False:
        sinks.append(progress)
    if metrics_jsonl is not None:
        sinks.append(MetricsFile(Path(metrics_jsonl)))
    if tracking is not None and tracking.enabled:
        spec = plan.job.spec
        sinks.append(
            TrackingProgress(
                build_sinks(tracking), job_name=plan.job.name, workflow=spec.name, params=spec.config
            )
        )
    plan = _with_sinks(plan, sinks)

    async def run() -> SimulationResult:
        pool = create_pool(backend_spec, registry=plan.registry, data=plan.data)
        try:
            return await simulate(plan, pool)
        finally:
            pool.close()

    return run


def _with_sinks(plan: Plan, sinks: Sequence[ProgressSink]) -> Plan:
    from dataclasses import replace

    return replace(plan, sinks=tuple(sinks))


def run_simulation(
    job: SimulationJob | str | Path,
    num_devices: int,
    *,
    runner: RunnerArg = None,
    backend: str = "local",
    backend_config: Mapping[str, object] | None = None,
    seed: int | None = None,
    data: DataSource | None = None,
    heterogeneity: Heterogeneity | None = None,
    device_info: Mapping[str, str] | None = None,
    store: str | Path = ":memory:",
    progress: bool | ProgressSink = False,
    metrics_jsonl: str | Path | None = None,
    tracking: TrackingConfig | None = None,
    timeout: float | None = None,
    share_components: bool = True,
    transport: str = "inprocess",
    time_scale: float = 1.0,
) -> SimulationResult:
    """Runs ``job`` on ``num_devices`` virtual devices with the real coordinator and Runner code.

    Args:
        job: The job (a :class:`SimulationJob`, or the path of a ``fedlink job submit`` job file).
        num_devices: Virtual devices; device ``i`` sees ``partition_id = i`` and
            ``num_partitions = num_devices`` in its task context.
        runner: The runner configuration: ``job_data`` (a mapping or JSON text, replacing the job's),
            a ``ResolverRegistry`` of app component types for the job's ``job_data``, or an
            ``Executor`` that every device runs (then the job must have no ``job_data``).
        backend: ``"local"`` (asyncio in this process, tasks on a thread pool) or ``"ray"`` (tasks on
            a pool of Ray actors; needs ``fedlink[ray]``; see :mod:`fedlink.simulation.ray_backend`).
        backend_config: The backend's settings, e.g. ``{"num_cpus": 2, "client_resources":
            {"num_cpus": 1}}``, or for Ray also ``address`` and ``actor_count``; unknown keys are an
            error listing the valid ones.
        seed: Replaces the job's FedAvg sampling seed; also seeds the heterogeneity draws (which use
            the job's seed when this is None).
        data: The data source every device's Runner gets (wrap it in ``PartitionedDataSource`` to give
            each device its partition).
        heterogeneity: Per-device slowdown, drop-out and link delay; default: none.
        device_info: Extra ``device_info`` of every virtual device (for the job's device selector).
        store: ``":memory:"`` (default: SQLite's in-memory database, blobs in a temporary directory),
            or the path of a new SQLite file to inspect later (its blobs go to ``<path>.blobs``).
        progress: Show a progress line on stderr (True), or report to a :class:`ProgressSink`.
        metrics_jsonl: Write one JSON line of metrics per round to this file.
        tracking: Log each round's metrics to MLflow and/or TensorBoard as well (one run per
            simulation; see ``docs/tracking.md``); default: the job file's ``[tracking]`` section.
        timeout: Seconds after which the simulation is aborted (default: enough for every round to
            run to its round timeout with every retry).
        share_components: Build each job component once and share it among devices (see
            :mod:`fedlink.simulation.components`); False builds them per device.
        transport: ``"inprocess"`` (default) or ``"grpc"``: the real gRPC server on loopback and a
            gRPC transport per device, to exercise the wire path (see :mod:`fedlink.simulation.engine`).
        time_scale: Run time this many times faster, for the coordinator and the devices alike: every
            timeout, lease, long poll and simulated compute time is in scaled seconds, and so are
            ``duration_s`` and ``virtual_time_s`` of the rounds (see :mod:`fedlink.simulation.clock`;
            real work in threads counts ``time_scale`` times over). 1 (default): real time.

    Returns:
        The final model, per-round metrics and timings, participation and failures.

    Raises:
        InvalidArgument: a bad argument, job or backend configuration (before anything runs).
        SimulationError: the workflow failed (its exception is the ``__cause__``), the job was
            aborted, or the timeout passed.
        KeyboardInterrupt: Ctrl-C, after the devices and the core were stopped.
    """
    make = _prepare(
        job,
        num_devices,
        runner=runner,
        backend=backend,
        backend_config=backend_config,
        seed=seed,
        data=data,
        heterogeneity=heterogeneity,
        device_info=device_info,
        store=store,
        progress=progress,
        metrics_jsonl=metrics_jsonl,
        tracking=tracking,
        timeout=timeout,
        share_components=share_components,
        transport=transport,
        time_scale=time_scale,
    )
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_here(make, time_scale)
    thread = _Thread(make, time_scale)
    thread.join()
    result: SimulationResult = thread.future.result()
    return result


async def run_simulation_async(
    job: SimulationJob | str | Path,
    num_devices: int,
    *,
    runner: RunnerArg = None,
    backend: str = "local",
    backend_config: Mapping[str, object] | None = None,
    seed: int | None = None,
    data: DataSource | None = None,
    heterogeneity: Heterogeneity | None = None,
    device_info: Mapping[str, str] | None = None,
    store: str | Path = ":memory:",
    progress: bool | ProgressSink = False,
    metrics_jsonl: str | Path | None = None,
    tracking: TrackingConfig | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 - bounds the simulation's own loop, in its thread
    share_components: bool = True,
    transport: str = "inprocess",
    time_scale: float = 1.0,
) -> SimulationResult:
    """:func:`run_simulation` for async code: awaits the simulation (run on its own loop and thread).

    Cancelling the awaiting task stops the simulation cleanly.
    """
    make = _prepare(
        job,
        num_devices,
        runner=runner,
        backend=backend,
        backend_config=backend_config,
        seed=seed,
        data=data,
        heterogeneity=heterogeneity,
        device_info=device_info,
        store=store,
        progress=progress,
        metrics_jsonl=metrics_jsonl,
        tracking=tracking,
        timeout=timeout,
        share_components=share_components,
        transport=transport,
        time_scale=time_scale,
    )
    thread = _Thread(make, time_scale)
    outcome = asyncio.wrap_future(thread.future)
    try:
        # shield: cancelling the caller must cancel the simulation (below), not just forget its future.
        result: SimulationResult = await asyncio.shield(outcome)
    except asyncio.CancelledError:
        # The simulation ends with its own CancelledError, which nobody awaits: retrieved here, so that
        # it is not logged as "Future exception was never retrieved" when the future is collected.
        outcome.add_done_callback(lambda done: done.cancelled() or done.exception())
        thread.cancel()
        await asyncio.get_running_loop().run_in_executor(None, thread.join)
        raise
    return result
