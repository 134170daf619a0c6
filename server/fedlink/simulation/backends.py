"""Where a simulation's executors and filters run: the backend seam, and the ``local`` backend.

A backend is an :class:`ExecutorPool`: the virtual devices' Runners hand their task work (filters in,
executor, filters out) to its :attr:`~ExecutorPool.executor`. Everything else — the coordinator
core, the store, the Runner loops and the in-process transport — is the same whatever the backend,
so a distributed backend (Ray) only has to provide another pool.

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

import functools
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, ParamSpec, TypeVar

from fedlink.common.errors import InvalidArgument

__all__ = ["BACKENDS", "ExecutorPool", "LocalConfig", "LocalPool", "TaskRouter", "create_pool"]

_P = ParamSpec("_P")
_T = TypeVar("_T")

_LOCAL_KEYS: Final = ("num_cpus", "client_resources")
_CLIENT_KEYS: Final = ("num_cpus",)


class ExecutorPool(ABC):
    """Runs the devices' task work (synchronous filters and executors) off the event loop."""

    @property
    @abstractmethod
    def executor(self) -> Executor:
        """Where the Runners' worker-thread calls go."""

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
        raw = dict(config or {})
        unknown = sorted(set(raw) - set(_LOCAL_KEYS))
        if unknown:
            raise InvalidArgument(
                f"unknown backend_config key(s) for the local backend: {', '.join(unknown)}; "
                f"valid: {', '.join(_LOCAL_KEYS)} (client_resources takes {', '.join(_CLIENT_KEYS)})"
            )
        num_cpus = _cpus("num_cpus", raw.get("num_cpus", os.cpu_count() or 1))
        resources = raw.get("client_resources", {})
        if not isinstance(resources, Mapping):
            raise InvalidArgument(f"backend_config.client_resources must be a mapping, not {resources!r}")
        unknown = sorted(set(resources) - set(_CLIENT_KEYS))
        if unknown:
            raise InvalidArgument(
                "unknown backend_config.client_resources key(s) for the local backend: "
                f"{', '.join(unknown)}; valid: {', '.join(_CLIENT_KEYS)}"
            )
        client = _cpus("client_resources.num_cpus", resources.get("num_cpus", 1))
        return cls(num_cpus=num_cpus, client_num_cpus=client)


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
    """A bounded thread pool in this process (numpy releases the GIL in its heavy loops)."""

    def __init__(self, config: LocalConfig) -> None:
        self._size = config.workers
        self._pool = ThreadPoolExecutor(max_workers=self._size, thread_name_prefix="fedlink-sim")

    @property
    def executor(self) -> Executor:
        """The thread pool."""
        return self._pool

    @property
    def size(self) -> int:
        """Worker threads."""
        return self._size

    def close(self) -> None:
        """Shuts the threads down (after the work already given to them)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


class TaskRouter(Executor):
    """The simulation loop's default executor: Runner task work to the pool, anything else to I/O threads.

    The Runner hands its task work to ``asyncio.to_thread`` (the loop's default executor), and so does
    the store for blob file I/O. Sharing one bounded pool would queue every store read and write behind
    the devices' training, so calls are routed: a bound method of a
    :class:`~fedlink.runner.loop.Runner` (as ``to_thread`` wraps it) goes to ``pool``, the rest to a
    small I/O pool. (A ``worker`` executor parameter on the Runner would make this explicit.)
    """

    def __init__(self, pool: ExecutorPool, *, io_threads: int = 4) -> None:
        from fedlink.runner.loop import Runner

        self._runner_type = Runner
        self._pool = pool
        self._io = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="fedlink-sim-io")

    def _is_task_work(self, fn: Callable[..., Any]) -> bool:
        target: object = fn
        if isinstance(fn, functools.partial) and fn.args:  # to_thread: partial(context.run, func, ...)
            target = fn.args[0]
        return isinstance(getattr(target, "__self__", None), self._runner_type)

    def submit(self, fn: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> Future[_T]:
        """Runs ``fn`` on the task pool or the I/O pool (see the class docstring)."""
        executor = self._pool.executor if self._is_task_work(fn) else self._io
        return executor.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Shuts the I/O threads down (the pool is closed by its owner)."""
        self._io.shutdown(wait=wait, cancel_futures=cancel_futures)


#: The backends this installation has, by name.
BACKENDS: Final = ("local",)


def create_pool(backend: str, config: Mapping[str, object] | None) -> ExecutorPool:
    """The executor pool of ``backend`` configured by ``config``.

    Raises:
        InvalidArgument: an unknown backend, or a bad ``config`` (unknown keys included).
    """
    if backend == "local":
        return LocalPool(LocalConfig.parse(config))
    if backend == "ray":
        raise InvalidArgument("the ray backend is not available yet; use backend='local'")
    raise InvalidArgument(f"unknown simulation backend {backend!r}; available: {', '.join(BACKENDS)}")
