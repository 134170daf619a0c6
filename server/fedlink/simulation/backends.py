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

import math
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from fedlink.common.errors import InvalidArgument
from fedlink.runner.config import ResolverRegistry
from fedlink.runner.loop import ExecutorWorker, TaskWorker
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
        self._worker = ExecutorWorker(self._pool)

    @property
    def worker(self) -> TaskWorker:
        """Runs task work on the thread pool."""
        return self._worker

    @property
    def size(self) -> int:
        """Worker threads."""
        return self._size

    def close(self) -> None:
        """Shuts the threads down (after the work already given to them)."""
        self._pool.shutdown(wait=True, cancel_futures=True)


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
