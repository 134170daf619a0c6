"""Job config (``job_data``) processing: the NVFlare edge format, ``@name`` references, resolvers.

``job_data`` is a JSON object (a string, or an already-parsed mapping)::

    {"components": [{"type": "SoftmaxRegressionTrainer", "name": "trainer",
                     "args": {"epochs": 2, "data_source": "@data"}},
                    {"type": "NpzDataSource", "name": "data", "args": {"path": "mnist.npz"}},
                    {"type": "GaussianPrivacy", "name": "dp", "args": {"clip_norm": 1.0}}],
     "executors": {"train": "@trainer", "*": "@trainer"},
     "in_filters": [], "out_filters": ["@dp"], "handlers": []}

* ``components`` is required; ``args`` is optional (default ``{}``). Component names are unique.
* Any string ``"@name"`` in ``args`` — at any depth of nested lists and objects — is replaced by the
  built component of that name (the same object each time it is referenced). Components are built in
  dependency order (referenced components first, otherwise in the order listed); a reference to an
  undeclared name, or a cycle, is an error that names it.
* ``executors`` maps task names, or ``"*"`` for any other task, to ``"@name"`` of an
  :class:`~fedlink.runner.spec.Executor`. As in NVFlare, when ``executors`` is absent a component
  named ``trainer`` serves every task.
* ``in_filters`` / ``out_filters`` / ``handlers`` are lists of ``"@name"`` of
  :class:`~fedlink.runner.spec.Filter` / :class:`~fedlink.runner.spec.EventHandler` components.
* Unknown top-level keys are refused (a misspelled ``"executor"`` should not silently do nothing).

The ``type`` of a component is looked up in a :class:`ResolverRegistry`: the built-ins of
:func:`fedlink.runner.builtins.builtin_registry` first, overridden by the app's registry. A registered
entry is a class or factory called as ``factory(**args)``, or a :class:`ComponentResolver` subclass
(NVFlare's way to build device-native objects), constructed as ``cls(type, name, args)`` and asked to
``resolve()``.
"""

from __future__ import annotations

import functools
import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from fedlink.common.errors import FedlinkError, InvalidArgument
from fedlink.runner.spec import EventHandler, Executor, Filter

__all__ = [
    "ComponentResolver",
    "JobConfig",
    "JobConfigError",
    "NoExecutorForTask",
    "ResolverRegistry",
    "process_job_data",
]

ANY_TASK: Final = "*"
_KEYS: Final = ("components", "executors", "in_filters", "out_filters", "handlers")
_LEGACY_TRAINER: Final = "trainer"


class JobConfigError(InvalidArgument):
    """``job_data`` is malformed; the message names the offending key, component or reference."""


class NoExecutorForTask(JobConfigError):
    """The job config has no executor for this task name (and no ``"*"`` fallback)."""

    def __init__(self, task_name: str, known: list[str]) -> None:
        listed = ", ".join(repr(k) for k in known) or "none"
        super().__init__(f"job config has no executor for task {task_name!r} (executors: {listed})")
        self.task_name = task_name


class ComponentResolver(ABC):
    """Builds a component whose object is not simply ``cls(**args)`` (NVFlare's resolver shape)."""

    def __init__(self, component_type: str, name: str, args: dict[str, Any]) -> None:
        self.component_type = component_type
        self.name = name
        self.args = args

    @abstractmethod
    def resolve(self) -> object:
        """Return the built component."""


Factory = Callable[..., object]


class ResolverRegistry:
    """Maps component type names to classes, factories or :class:`ComponentResolver` subclasses."""

    def __init__(self, entries: Mapping[str, Factory] | None = None) -> None:
        self._entries: dict[str, Factory] = {}
        for type_name, factory in (entries or {}).items():
            self.register(type_name, factory)

    def register(self, type_name: str, factory: Factory) -> None:
        """Add or replace the entry for ``type_name``.

        Raises:
            InvalidArgument: The name is empty or the factory is not callable.
        """
        if not isinstance(type_name, str) or not type_name:
            raise InvalidArgument(f"component type names are non-empty strings, not {type_name!r}")
        if not callable(factory):
            raise InvalidArgument(f"resolver for {type_name!r} is not callable: {factory!r}")
        self._entries[type_name] = factory

    def get(self, type_name: str) -> Factory:
        """The entry for ``type_name``.

        Raises:
            KeyError: No such type (the config turns this into a :class:`JobConfigError`).
        """
        return self._entries[type_name]

    def merged(self, overrides: ResolverRegistry | None) -> ResolverRegistry:
        """A new registry: these entries, then ``overrides``' entries replacing any of the same name."""
        result = ResolverRegistry()
        result._entries = dict(self._entries)  # both were checked as they were registered
        if overrides is not None:
            result._entries.update(overrides._entries)
        return result

    def __contains__(self, type_name: object) -> bool:
        return type_name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)


@dataclass(frozen=True, slots=True)
class JobConfig:
    """The built components of one job, as the Runner uses them."""

    components: Mapping[str, object]
    """Every built component, by name."""
    executors: Mapping[str, Executor]
    """Executors by task name; ``"*"`` serves any task not listed."""
    in_filters: tuple[Filter, ...]
    out_filters: tuple[Filter, ...]
    handlers: tuple[EventHandler, ...]

    def executor_for(self, task_name: str) -> Executor:
        """The executor for ``task_name``, else the ``"*"`` one.

        Raises:
            NoExecutorForTask: Neither exists.
        """
        executor = self.executors.get(task_name) or self.executors.get(ANY_TASK)
        if executor is None:
            raise NoExecutorForTask(task_name, sorted(self.executors))
        return executor


@dataclass(frozen=True, slots=True)
class _Spec:
    type: str
    name: str
    args: dict[str, Any]
    refs: tuple[str, ...]


def process_job_data(
    job_data: str | bytes | Mapping[str, Any], registry: ResolverRegistry | None = None
) -> JobConfig:
    """Parse and build a job config.

    Args:
        job_data: The JSON document (``str``/``bytes``) or the parsed object.
        registry: The app's resolvers; they override the built-ins of the same type name.

    Returns:
        The built :class:`JobConfig`.

    Raises:
        JobConfigError: Invalid JSON, a wrong shape, an unknown type, a missing or cyclic reference,
            a duplicate name, a constructor that rejects its args, or a filter/executor/handler
            reference to a component of the wrong kind. The message names the offending entry.
    """
    doc = _parse(job_data)
    resolvers = _builtins().merged(registry)
    specs = _component_specs(doc.get("components"))
    components: dict[str, object] = {}
    for spec in _dependency_order(specs):
        components[spec.name] = _build(spec, resolvers, components)

    executors = _executors(doc, components)
    return JobConfig(
        components=components,
        executors=executors,
        in_filters=_filters(doc, "in_filters", components),
        out_filters=_filters(doc, "out_filters", components),
        handlers=_handlers(doc, components),
    )


def _parse(job_data: str | bytes | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(job_data, str | bytes):
        try:
            doc = json.loads(job_data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise JobConfigError(f"job_data is not valid JSON: {exc}") from None
    else:
        doc = job_data
    if not isinstance(doc, Mapping):
        raise JobConfigError(f"job_data must be a JSON object, not {type(doc).__name__}")
    unknown = sorted(set(doc) - set(_KEYS))
    if unknown:
        raise JobConfigError(f"job_data has unknown key(s) {unknown}; allowed: {list(_KEYS)}")
    return doc


def _component_specs(raw: object) -> list[_Spec]:
    if not isinstance(raw, list):
        raise JobConfigError(f"job_data 'components' must be a list, not {type(raw).__name__}")
    specs: dict[str, _Spec] = {}
    for index, entry in enumerate(raw):
        where = f"components[{index}]"
        if not isinstance(entry, Mapping):
            raise JobConfigError(f"{where} must be an object with type, name and args")
        unknown = sorted(set(entry) - {"type", "name", "args"})
        if unknown:
            raise JobConfigError(f"{where} has unknown key(s) {unknown}; allowed: type, name, args")
        for key in ("type", "name"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise JobConfigError(f"{where} needs a non-empty string {key!r}")
        name, args = entry["name"], entry.get("args", {})
        where = f"{where} ({name!r})"
        if not isinstance(args, Mapping):
            raise JobConfigError(f"{where}: 'args' must be an object, not {type(args).__name__}")
        if name in specs:
            raise JobConfigError(f"{where}: duplicate component name {name!r}")
        specs[name] = _Spec(entry["type"], name, dict(args), tuple(dict.fromkeys(_refs_in(args))))
    for spec in specs.values():
        for ref in spec.refs:
            if ref not in specs:
                raise JobConfigError(f"component {spec.name!r} references undefined component '@{ref}'")
    return list(specs.values())


def _refs_in(value: object) -> Iterator[str]:
    if isinstance(value, str):
        if value.startswith("@"):
            yield value[1:]
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _refs_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _refs_in(item)


def _dependency_order(specs: list[_Spec]) -> list[_Spec]:
    """Depth-first topological order, declaration order among independent components."""
    by_name = {spec.name: spec for spec in specs}
    done: set[str] = set()
    order: list[_Spec] = []
    path: list[str] = []

    def visit(name: str) -> None:
        if name in done:
            return
        if name in path:
            cycle = [*path[path.index(name) :], name]
            raise JobConfigError(f"component reference cycle: {' -> '.join(cycle)}")
        path.append(name)
        for ref in by_name[name].refs:
            visit(ref)
        path.pop()
        done.add(name)
        order.append(by_name[name])

    for spec in specs:
        visit(spec.name)
    return order


def _substitute(value: Any, built: Mapping[str, object]) -> Any:
    if isinstance(value, str) and value.startswith("@"):
        return built[value[1:]]
    if isinstance(value, Mapping):
        return {key: _substitute(item, built) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_substitute(item, built) for item in value]
    return value


def _build(spec: _Spec, resolvers: ResolverRegistry, built: Mapping[str, object]) -> object:
    where = f"component {spec.name!r} (type {spec.type!r})"
    try:
        factory = resolvers.get(spec.type)
    except KeyError:
        raise JobConfigError(
            f"component {spec.name!r} has unknown type {spec.type!r}; known types: {', '.join(resolvers)}"
        ) from None
    args = _substitute(spec.args, built)
    try:
        if isinstance(factory, type) and issubclass(factory, ComponentResolver):
            return factory(spec.type, spec.name, args).resolve()
        _check_signature(factory, args, where)
        return factory(**args)
    except JobConfigError:
        raise
    except (TypeError, ValueError, FedlinkError) as exc:
        raise JobConfigError(f"{where} rejected its args: {exc}") from exc


@functools.cache
def _builtins() -> ResolverRegistry:
    """The built-in types, checked once (``merged`` copies them: this one is never changed)."""
    # Imported here: the built-ins import the spec, and the spec must not import the config.
    from fedlink.runner.builtins import builtin_registry

    return builtin_registry()


@functools.lru_cache(maxsize=1024)
def _signature_of(factory: Factory) -> inspect.Signature | None:
    # Cached per factory: a class without an __init__ of its own has its signature parsed from text
    # (tokenize, compile), ~100 us, and a simulation builds each device's components (10,000 times).
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins and C types have no signature
        return None


def _check_signature(factory: Factory, args: Mapping[str, Any], where: str) -> None:
    # Binding first turns "__init__() got an unexpected keyword argument" into a message naming
    # the component, and keeps TypeErrors raised inside a constructor distinguishable.
    try:
        signature = _signature_of(factory)
    except TypeError:  # an unhashable factory: not cached
        signature = _signature_of.__wrapped__(factory)
    if signature is None:
        return
    try:
        signature.bind(**args)
    except TypeError as exc:
        accepted = [p for p in signature.parameters if p not in ("self", "args", "kwargs")]
        raise JobConfigError(f"{where}: bad args {sorted(args)}: {exc}; accepted: {accepted}") from None


def _ref_target(value: object, where: str, components: Mapping[str, object]) -> object:
    if not isinstance(value, str) or not value.startswith("@"):
        raise JobConfigError(f"{where} must be a reference like '@name', not {value!r}")
    try:
        return components[value[1:]]
    except KeyError:
        raise JobConfigError(f"{where} references undefined component {value!r}") from None


def _executors(doc: Mapping[str, Any], components: Mapping[str, object]) -> dict[str, Executor]:
    raw = doc.get("executors")
    if raw is None:
        # NVFlare's legacy form: no executors, a component named "trainer" runs every task.
        legacy = components.get(_LEGACY_TRAINER)
        raw = {ANY_TASK: f"@{_LEGACY_TRAINER}"} if legacy is not None else {}
    if not isinstance(raw, Mapping):
        raise JobConfigError(f"job_data 'executors' must be an object (task name -> '@name'), not {raw!r}")
    executors: dict[str, Executor] = {}
    for task_name, ref in raw.items():
        where = f"executors[{task_name!r}]"
        target = _ref_target(ref, where, components)
        if not isinstance(target, Executor):
            raise JobConfigError(f"{where} = {ref!r} is a {type(target).__name__}, not an Executor")
        executors[task_name] = target
    return executors


def _ref_list(doc: Mapping[str, Any], key: str, components: Mapping[str, object]) -> Iterator[_Ref]:
    raw = doc.get(key, [])
    if not isinstance(raw, list):
        raise JobConfigError(f"job_data {key!r} must be a list of '@name' references, not {raw!r}")
    for index, ref in enumerate(raw):
        where = f"{key}[{index}]"
        yield _Ref(where, ref, _ref_target(ref, where, components))


@dataclass(frozen=True, slots=True)
class _Ref:
    where: str
    ref: str
    target: object

    def wrong_kind(self, what: str) -> JobConfigError:
        return JobConfigError(f"{self.where} = {self.ref!r} is a {type(self.target).__name__}, not {what}")


def _filters(doc: Mapping[str, Any], key: str, components: Mapping[str, object]) -> tuple[Filter, ...]:
    result: list[Filter] = []
    for item in _ref_list(doc, key, components):
        if not isinstance(item.target, Filter):
            raise item.wrong_kind("a Filter (with a filter() method)")
        result.append(item.target)
    return tuple(result)


def _handlers(doc: Mapping[str, Any], components: Mapping[str, object]) -> tuple[EventHandler, ...]:
    result: list[EventHandler] = []
    for item in _ref_list(doc, "handlers", components):
        if not isinstance(item.target, EventHandler):
            raise item.wrong_kind("an EventHandler (with a handle_event() method)")
        result.append(item.target)
    return tuple(result)
