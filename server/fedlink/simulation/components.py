"""Job components shared by every virtual device instead of built once per device.

Each Runner builds its job's components from ``job_data``. Ten thousand virtual devices would build
ten thousand trainers and data sources — and a data source that loads a file, or a
:class:`~fedlink.runner.data.PartitionedDataSource` that splits it, would do that work ten thousand
times. :func:`shared_registry` wraps every component type so that the same type with the same args
gives the same object to every device. This is safe for the built-in components, which keep no
per-device state (the partitioned source caches each partition and is thread-safe); pass
``share_components=False`` to the simulation for components that do keep state.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Hashable, Mapping
from typing import Any

from fedlink.runner.builtins import builtin_registry
from fedlink.runner.config import ComponentResolver, Factory, ResolverRegistry

__all__ = ["shared_registry"]


def _key(value: Any) -> Hashable:
    """A hashable key of a component's args; built components (from ``@refs``) count by identity."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return (type(value).__name__, value)
    if isinstance(value, Mapping):
        return ("map", tuple(sorted((str(k), _key(v)) for k, v in value.items())))
    if isinstance(value, list | tuple):
        return ("seq", tuple(_key(v) for v in value))
    return ("obj", id(value))


def _memoized(
    type_name: str, factory: Factory, cache: dict[Hashable, object], lock: threading.Lock
) -> Factory:
    # Keeps the signature (which the job config checks the args against), not the factory's __dict__:
    # a class's would carry its ABC cache, which cannot be pickled (the ray backend ships registries).
    @functools.wraps(factory, updated=())
    def build(**args: Any) -> object:
        key = (type_name, _key(args))
        with lock:
            if key not in cache:
                cache[key] = factory(**args)
            return cache[key]

    # Every device's job config checks its args against the signature: worked out here once, not
    # by inspect per device (a few hundred microseconds each, 10,000 times over).
    # (Some builtins and C types have none: then there is nothing to check against, as before.)
    with contextlib.suppress(TypeError, ValueError):
        build.__signature__ = inspect.signature(factory)  # type: ignore[attr-defined]
    return build


def shared_registry(app: ResolverRegistry | None) -> ResolverRegistry:
    """The built-in types overridden by ``app``'s, each returning one shared object per distinct args.

    :class:`~fedlink.runner.config.ComponentResolver` entries are left as they are (built per device):
    they decide themselves what they return.
    """
    merged = builtin_registry().merged(app)
    cache: dict[Hashable, object] = {}
    lock = threading.Lock()
    shared = ResolverRegistry()
    for type_name in merged:
        factory = merged.get(type_name)
        if isinstance(factory, type) and issubclass(factory, ComponentResolver):
            shared.register(type_name, factory)
        else:
            shared.register(type_name, _memoized(type_name, factory, cache, lock))
    return shared
