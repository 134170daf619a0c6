"""Where a simulation's executors and filters run: the backend seam, and the ``local`` backend.

A backend is an :class:`ExecutorPool`: the virtual devices' Runners hand their task work (filters in,
executor, filters out) to its :attr:`~ExecutorPool.worker` (the Runner's ``worker=`` seam).
Everything else — the coordinator core, the store, the Runner loops and the transport — is the same
whatever the backend. ``ray`` (:mod:`fedlink.simulation.ray_backend`) runs the work on Ray actors.

``backend_config`` of the ``local`` backend (unknown keys are an error that lists these):

==============================  =================================================================
key                             meaning
==============================  =================================================================
``num_cpus``                    CPUs the simulation may use (default: all of this machine's)
``client_resources.num_cpus``   CPUs one task needs (default 1); tasks running at once =
                                ``max(1, floor(num_cpus / client_resources.num_cpus))``
==============================  =================================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import math
import os
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fedlink.common.dxo import DXO
from fedlink.common.errors import InvalidArgument
from fedlink.runner.config import ResolverRegistry
from fedlink.runner.loop import TaskWork, TaskWorker
from fedlink.runner.spec import DataSource

if TYPE_CHECKING:
    from fedlink.simulation.ray_backend import RayConfig

__all__ = ["BACKENDS", "ExecutorPool", "LocalConfig", "LocalPool", "check_backend", "create_pool"]

_LOCAL_KEYS: Final = ("num_cpus", "client_resources")
_CLIENT_KEYS: Final = ("num_cpus",)


class ExecutorPool(ABC):
    """Runs the devices' task work (synchronous filters and executors) off the event loop."""

    @property
    @abstractmethod
    def worker(self) -> TaskWorker:
        """What every Runner of the simulation is given as ``worker=``."""

    @property
    @abstractmethod
    def size(self) -> int:
        """How many tasks may run at once."""

    @abstractmethod
    def close(self) -> None:
        """Waits for running work and frees the pool's resources; safe to call twice."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalConfig:
    """The ``local`` backend's configuration, checked."""

    #: CPUs the simulation may use.
    num_cpus: float
    #: CPUs one task needs.
    client_num_cpus: float

    @property
    def workers(self) -> int:
        """Tasks that may run at once."""
        return max(1, math.floor(self.num_cpus / self.client_num_cpus + 1e-9))

    @classmethod
    def parse(cls, config: Mapping[str, object] | None) -> LocalConfig:
        """Checks a ``backend_config`` mapping (see the module docstring for the keys).

        Raises:
            InvalidArgument: an unknown key (the message lists the valid ones) or a bad value.
        """
        raw, resources = split_backend_config(config, "local", _LOCAL_KEYS, _CLIENT_KEYS)
        num_cpus = _cpus("num_cpus", raw.get("num_cpus", os.cpu_count() or 1))
        client = _cpus("client_resources.num_cpus", resources.get("num_cpus", 1))
        return cls(num_cpus=num_cpus, client_num_cpus=client)


def split_backend_config(
    config: Mapping[str, object] | None, backend: str, keys: Sequence[str], client_keys: Sequence[str]
) -> tuple[dict[str, object], Mapping[str, object]]:
    """A ``backend_config`` and its ``client_resources``, after refusing keys the backend does not know.

    Raises:
        InvalidArgument: an unknown key (the message lists the valid ones), or client_resources is
            not a mapping.
    """
    raw = dict(config or {})
    unknown = sorted(set(raw) - set(keys))
    if unknown:
        raise InvalidArgument(
            f"unknown backend_config key(s) for the {backend} backend: {', '.join(unknown)}; "
            f"valid: {', '.join(keys)} (client_resources takes {', '.join(client_keys)})"
        )
    resources = raw.get("client_resources", {})
    if not isinstance(resources, Mapping):
        raise InvalidArgument(f"backend_config.client_resources must be a mapping, not {resources!r}")
    unknown = sorted(set(resources) - set(client_keys))
    if unknown:
        raise InvalidArgument(
            f"unknown backend_config.client_resources key(s) for the {backend} backend: "
            f"{', '.join(unknown)}; valid: {', '.join(client_keys)}"
        )
    return raw, resources


def _cpus(key: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise InvalidArgument(f"backend_config.{key} must be a positive number, not {value!r}")
    return float(value)


class LocalPool(ExecutorPool):
    """A bounded pool of threads in this process (numpy releases the GIL in its heavy loops).

    Lighter than a :class:`~concurrent.futures.ThreadPoolExecutor` behind the Runner's
    :class:`~fedlink.runner.loop.ExecutorWorker`: a task is one queue entry and one event-loop
    future, with no ``concurrent.futures.Future`` (a lock and a condition) per task, which at 10,000
    devices was a tenth of the event loop's time.
    """

    def __init__(self, config: LocalConfig) -> None:
        self._size = config.workers
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        threads = range(self._size)
        self._threads = [
            threading.Thread(target=self._serve, name=f"fedlink-sim_{i}", daemon=True) for i in threads
        ]
        for thread in self._threads:
            thread.start()
        self._closed = False

    @property
    def worker(self) -> TaskWorker:
        """Runs task work on the pool's threads."""
        return self

    @property
    def size(self) -> int:
        """Worker threads."""
        return self._size

    async def run(self, work: TaskWork) -> DXO:
        """Runs ``work.run_here`` on one of the pool's threads (with the caller's context variables)."""
        if self._closed:
            raise RuntimeError("the simulation's pool is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[DXO] = loop.create_future()
        self._queue.put((loop, future, functools.partial(contextvars.copy_context().run, work.run_here)))
        return await future

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            loop, future, call = item
            try:
                result, error = call(), None
            except BaseException as exc:  # handed to the awaiting Runner, which reports it
                result, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, future, result, error)
            del item, future, call, result, error  # not kept alive until the next task

    def close(self) -> None:
        """Stops the threads (after the work already given to them); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            thread.join()


_Item = tuple[asyncio.AbstractEventLoop, "asyncio.Future[DXO]", Callable[[], DXO]]


def _settle(future: asyncio.Future[DXO], result: DXO | None, error: BaseException | None) -> None:
    if future.done():  # the Runner gave up on it (cancelled)
        return
    if error is not None:
        future.set_exception(error)
    else:
        assert result is not None
        future.set_result(result)


#: The backends, by name (``ray`` needs the ``fedlink[ray]`` extra).
BACKENDS: Final = ("local", "ray")


def check_backend(backend: str, config: Mapping[str, object] | None) -> LocalConfig | RayConfig:
    """Checks ``backend`` and its ``config`` without starting anything.

    Raises:
        InvalidArgument: an unknown backend, or a bad ``config`` (unknown keys included).
    """
    if backend == "local":
        return LocalConfig.parse(config)
    if backend == "ray":
        from fedlink.simulation.ray_backend import RayConfig

        return RayConfig.parse(config)
    raise InvalidArgument(f"unknown simulation backend {backend!r}; available: {', '.join(BACKENDS)}")


def create_pool(
    config: LocalConfig | RayConfig, *, registry: ResolverRegistry | None, data: DataSource | None
) -> ExecutorPool:
    """Starts the pool ``config`` describes.

    Args:
        config: From :func:`check_backend`.
        registry: The app's component types (a pool in other processes builds the job's components).
        data: The devices' data source (likewise).

    Raises:
        Unavailable: the Ray backend could not start or join its cluster.
        FailedPrecondition: the Ray backend was asked for, but Ray is not installed.
    """
    if isinstance(config, LocalConfig):
        return LocalPool(config)
    from fedlink.simulation.ray_backend import RayPool

    return RayPool(config, registry=registry, data=data)
