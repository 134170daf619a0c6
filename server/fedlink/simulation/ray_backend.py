"""The ``ray`` simulation backend: the devices' executors and filters run on a pool of Ray actors.

The coordinator core, the store and every Runner loop stay in this (the driver's) process and event
loop; only the task work travels. Each actor is given, once, the app's component registry and the data
source; it builds a job's components from ``job_data`` (once per job and actor) and runs
:func:`~fedlink.runner.loop.execute_task`. A task's input DXO is put in Ray's object store once per
model (the in-process transport hands every device of a round the same arrays) and its output DXO
comes back as the task's return value. An actor runs one task at a time, so ``actor_count`` tasks
run at once.

``backend_config`` keys (unknown keys are an error that lists these):

==============================  =================================================================
key                             meaning
==============================  =================================================================
``address``                     a Ray cluster to join (``"auto"``, ``"ray://host:10001"``,
                                ``"host:6379"``); ``None`` (default) starts a local Ray instance,
                                which is shut down at the end
``num_cpus``                    CPUs of the local instance (default: Ray's, all of this machine's);
                                not with ``address``
``client_resources.num_cpus``   CPUs each actor reserves (default 1)
``client_resources.num_gpus``   GPUs each actor reserves (default 0)
``actor_count``                 actors in the pool (default: as many as the cluster's CPUs (and
                                GPUs) hold, at least 1)
==============================  =================================================================

Objects that hold a ``threading.Lock`` (the partitioned data source, the shared component registry)
travel to the actors with a fresh lock: a lock's state means nothing in another process. Inside an
actor, ``ctx[ContextKey.RUNNER]`` is ``None``: the Runner stays in the driver.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from fedlink.common.dxo import DXO
from fedlink.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from fedlink.runner.config import JobConfig, ResolverRegistry, process_job_data
from fedlink.runner.context import Signal
from fedlink.runner.loop import TaskWork, TaskWorker, execute_task, job_context
from fedlink.runner.spec import DataSource, Filter
from fedlink.simulation.backends import ExecutorPool, _cpus, split_backend_config

__all__ = ["RayConfig", "RayPool", "RayWorker"]

_KEYS: Final = ("address", "num_cpus", "client_resources", "actor_count")
_CLIENT_KEYS: Final = ("num_cpus", "num_gpus")
#: Input models kept in the object store (the current round's and a few before it).
_MODEL_CACHE: Final = 4
#: Jobs whose built components an actor keeps.
_JOB_CACHE: Final = 4
#: How often a waiting task looks at its abort signal.
_SIGNAL_POLL_S: Final = 0.1
#: How long the actors may take to start (Ray starts a worker process for each).
_READY_TIMEOUT_S: Final = 120.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RayConfig:
    """The ``ray`` backend's configuration, checked (see the module docstring for the keys)."""

    #: The cluster to join; None starts a local instance.
    address: str | None = None
    #: CPUs of a local instance (None: Ray's default).
    num_cpus: int | None = None
    #: Resources each actor reserves.
    client_num_cpus: float = 1.0
    client_num_gpus: float = 0.0
    #: Actors in the pool (None: as many as the cluster holds).
    actor_count: int | None = None

    @classmethod
    def parse(cls, config: Mapping[str, object] | None) -> RayConfig:
        """Checks a ``backend_config`` mapping.

        Raises:
            InvalidArgument: an unknown key (the message lists the valid ones) or a bad value.
        """
        raw, resources = split_backend_config(config, "ray", _KEYS, _CLIENT_KEYS)
        address = raw.get("address")
        if address is not None and (not isinstance(address, str) or not address):
            raise InvalidArgument(
                f"backend_config.address must be a Ray address (text) or None, not {address!r}"
            )
        num_cpus = raw.get("num_cpus")
        if num_cpus is not None:
            if address is not None:
                raise InvalidArgument("backend_config.num_cpus sizes a local Ray instance: not with address")
            num_cpus = _count("num_cpus", num_cpus)
        gpus = resources.get("num_gpus", 0)
        if isinstance(gpus, bool) or not isinstance(gpus, int | float) or not math.isfinite(gpus) or gpus < 0:
            raise InvalidArgument(f"backend_config.client_resources.num_gpus must be >= 0, not {gpus!r}")
        actors = raw.get("actor_count")
        return cls(
            address=address,
            num_cpus=num_cpus,
            client_num_cpus=_cpus("client_resources.num_cpus", resources.get("num_cpus", 1)),
            client_num_gpus=float(gpus),
            actor_count=None if actors is None else _count("actor_count", actors),
        )


def _count(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"backend_config.{key} must be an integer >= 1, not {value!r}")
    return value


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise FailedPrecondition(
            "the ray backend needs Ray: pip install 'fedlink[ray]' (or use backend='local')"
        ) from None
    return ray


def _fresh_lock(_: object) -> Any:
    return threading.Lock()


def _fresh_rlock(_: object) -> Any:
    return threading.RLock()


def _no_state(_: object) -> None:
    return None


def _register_lock_serializers(ray: Any) -> None:
    """Locks travel as fresh locks (see the module docstring); Ray's cloudpickle refuses them."""
    ray.util.register_serializer(type(threading.Lock()), serializer=_no_state, deserializer=_fresh_lock)
    ray.util.register_serializer(type(threading.RLock()), serializer=_no_state, deserializer=_fresh_rlock)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Call:
    """What an actor needs besides the input DXO to run one task."""

    job_id: str
    job_data: str
    task_id: str
    task_name: str
    partition: tuple[int, int] | None
    app_in_filters: tuple[Filter, ...]
    app_out_filters: tuple[Filter, ...]


class TaskActor:
    """One Ray actor of the pool (made remote by :class:`RayPool`): runs one task at a time."""

    def __init__(self, setup: tuple[ResolverRegistry | None, DataSource | None]) -> None:
        self._registry, self._data = setup
        self._configs: OrderedDict[str, JobConfig] = OrderedDict()

    def ready(self) -> bool:
        """True once the actor has started (and its setup arrived)."""
        return True

    def run(self, task_data: DXO | None, call: _Call) -> DXO:
        """Runs one task; raises what the job config, a filter or the executor raised."""
        config = self._configs.get(call.job_id)
        if config is None:
            config = process_job_data(call.job_data, self._registry)
            self._configs[call.job_id] = config
            while len(self._configs) > _JOB_CACHE:
                self._configs.popitem(last=False)
        return execute_task(
            config,
            job_context(config, self._data, call.partition),
            task_id=call.task_id,
            task_name=call.task_name,
            task_data=task_data,
            app_in_filters=call.app_in_filters,
            app_out_filters=call.app_out_filters,
            signal=Signal(),  # an abort is handled by the driver (it cancels the call)
        )


class RayWorker(TaskWorker):
    """The Runners' :class:`TaskWorker`: hands each task to an idle actor and awaits its result."""

    def __init__(self, ray: Any, actors: Sequence[Any]) -> None:
        self._ray = ray
        self._actors = tuple(actors)
        self._idle: asyncio.Queue[Any] | None = None
        #: ids of a model's arrays → (the arrays, its meta, its object in the store). The arrays are
        #: kept so that their ids cannot be reused by other arrays while cached.
        self._models: OrderedDict[tuple[int, ...], tuple[tuple[object, ...], dict[str, Any], Any]] = (
            OrderedDict()
        )
        #: Models put in the object store (for tests and progress figures).
        self.models_put = 0

    def _model_ref(self, dxo: DXO | None) -> Any:
        if dxo is None:
            return None
        arrays = tuple(dxo.data.values())
        key = tuple(id(a) for a in arrays)
        cached = self._models.get(key)
        if cached is not None and dxo.meta == cached[1]:
            self._models.move_to_end(key)
            return cached[2]
        ref = self._ray.put(dxo)
        self.models_put += 1
        self._models[key] = (arrays, dict(dxo.meta), ref)
        while len(self._models) > _MODEL_CACHE:
            self._models.popitem(last=False)
        return ref

    async def run(self, work: TaskWork) -> DXO:
        """Runs ``work`` on an actor; an abort signal cancels the remote call and raises Aborted."""
        if self._idle is None:
            self._idle = asyncio.Queue()
            for actor in self._actors:
                self._idle.put_nowait(actor)
        work.signal.check()
        model = self._model_ref(work.task_data)
        call = _Call(
            job_id=work.job_id,
            job_data=work.job_data,
            task_id=work.task_id,
            task_name=work.task_name,
            partition=work.partition,
            app_in_filters=work.app_in_filters,
            app_out_filters=work.app_out_filters,
        )
        actor = await self._idle.get()
        try:
            return await self._await(actor.run.remote(model, call), work.signal)
        finally:
            self._idle.put_nowait(actor)

    async def _await(self, ref: Any, signal: Signal) -> DXO:
        future: asyncio.Future[DXO] = asyncio.wrap_future(ref.future())
        while not future.done():
            await asyncio.wait({future}, timeout=_SIGNAL_POLL_S)
            if signal.triggered and not future.done():
                future.cancel()
                self._ray.cancel(ref)
                signal.check()
        try:
            return future.result()
        except self._ray.exceptions.RayTaskError as exc:
            cause = exc.cause  # the executor's own exception: its type and text become the failure
            if isinstance(cause, Exception):
                raise cause from None
            raise


class RayPool(ExecutorPool):
    """A pool of :class:`TaskActor` on a Ray cluster (started here, or joined)."""

    def __init__(
        self, config: RayConfig, *, registry: ResolverRegistry | None, data: DataSource | None
    ) -> None:
        ray = _import_ray()
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            try:
                if config.address is None:
                    ray.init(num_cpus=config.num_cpus, include_dashboard=False, logging_level="WARNING")
                else:
                    ray.init(address=config.address, logging_level="WARNING")
            except (ConnectionError, RuntimeError) as exc:
                raise Unavailable(f"cannot start or join the Ray cluster: {exc}") from exc
            self._started = True
        try:
            _register_lock_serializers(ray)
            self._actors = self._start_actors(config, registry, data)
        except BaseException:
            self.close()
            raise
        self._worker = RayWorker(ray, self._actors)

    def _start_actors(
        self, config: RayConfig, registry: ResolverRegistry | None, data: DataSource | None
    ) -> list[Any]:
        ray = self._ray
        resources = ray.cluster_resources()
        cpus, gpus = float(resources.get("CPU", 0)), float(resources.get("GPU", 0))
        fits = math.floor(cpus / config.client_num_cpus + 1e-9)
        if config.client_num_gpus > 0:
            fits = min(fits, math.floor(gpus / config.client_num_gpus + 1e-9))
        count = config.actor_count or fits
        if not 1 <= count <= fits:
            # Actors that do not fit would wait for resources for ever: say so instead of hanging.
            raise InvalidArgument(
                f"{count} Ray actors of {config.client_num_cpus:g} CPU / {config.client_num_gpus:g} GPU "
                f"do not fit the cluster ({cpus:g} CPU, {gpus:g} GPU): lower actor_count or client_resources"
            )
        setup = ray.put((registry, data))  # sent once; every actor resolves the same object
        remote = ray.remote(TaskActor).options(
            num_cpus=config.client_num_cpus, num_gpus=config.client_num_gpus
        )
        actors = [remote.remote(setup) for _ in range(count)]
        try:
            ray.get([actor.ready.remote() for actor in actors], timeout=_READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise Unavailable(
                f"the {count} Ray actors did not start within {_READY_TIMEOUT_S:.0f}s"
            ) from None
        except ray.exceptions.RayError as exc:
            raise Unavailable(f"the Ray actors failed to start: {exc}") from exc
        return actors

    @property
    def worker(self) -> TaskWorker:
        """Runs task work on the actors."""
        return self._worker

    @property
    def size(self) -> int:
        """Actors in the pool."""
        return len(self._actors)

    def close(self) -> None:
        """Kills the actors; shuts Ray down if this pool started it. Safe to call twice."""
        for actor in getattr(self, "_actors", ()):
            with contextlib.suppress(Exception):  # an actor already gone is what we want
                self._ray.kill(actor)
        self._actors = []
        if self._started:
            self._started = False
            self._ray.shutdown()
