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

A type that is in neither and is spelled as an import path, ``pkg.module:Name`` (``Name`` may be
dotted, ``Outer.Inner``), is imported — but only if the module matches one of the ``allow_components``
patterns (``fnmatch``, e.g. ``"mypkg.*"``) the caller passes: on a device that is code chosen by whoever
submitted the job, so the device's owner decides (:class:`ComponentNotAllowed` otherwise, before the
module is imported). The object found must be a public class or factory of an allowed module: an
allowed module cannot lend out what it imported (``mypkg.mod:subprocess.run``, ``mypkg.mod:Popen``
after ``from subprocess import Popen``, and private or dunder names are refused).
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import importlib
import inspect
import json
import re
import types
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from fedlink.common.errors import FedlinkError, InvalidArgument
from fedlink.runner.spec import EventHandler, Executor, Filter

__all__ = [
    "ALLOW_COMPONENTS",
    "ComponentNotAllowed",
    "ComponentResolver",
    "ComponentSpec",
    "JobConfig",
    "JobConfigError",
    "JobOutline",
    "NoExecutorForTask",
    "ResolverRegistry",
    "check_args",
    "did_you_mean",
    "is_import_path",
    "load_component_type",
    "module_allowed",
    "outline_job_data",
    "process_job_data",
    "split_import_path",
]

ANY_TASK: Final = "*"
_KEYS: Final = ("components", "executors", "in_filters", "out_filters", "handlers")
_LEGACY_TRAINER: Final = "trainer"
#: The runner setting that allows import-path component types (named in every refusal).
ALLOW_COMPONENTS: Final = "allow_components"
_IDENTIFIER: Final = r"[A-Za-z_][A-Za-z0-9_]*"
_IMPORT_PATH: Final = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*")


class JobConfigError(InvalidArgument):
    """``job_data`` is malformed; the message names the offending key, component or reference."""


class ComponentNotAllowed(JobConfigError):
    """A component type names a module (``pkg.module:Name``) that the ``allow_components`` patterns do
    not allow; nothing of it was imported."""


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
class ComponentSpec:
    """One entry of ``components``, as written (nothing built)."""

    type: str
    name: str
    args: dict[str, Any]
    #: The names its args reference (``"@name"``), each once, in the order first found.
    refs: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class JobOutline:
    """A ``job_data`` document checked for shape, names, references and cycles, with nothing built."""

    #: The parsed document (``executors``, the filter and handler lists as written).
    document: Mapping[str, Any]
    #: The components in the order they are built: referenced components first.
    components: tuple[ComponentSpec, ...]

    def executor_refs(self) -> Mapping[str, object]:
        """``executors`` as written (task name -> ``"@name"``); NVFlare's legacy rule when absent: a
        component named ``trainer`` serves every task."""
        raw = self.document.get("executors")
        if raw is None:
            legacy = any(spec.name == _LEGACY_TRAINER for spec in self.components)
            return {ANY_TASK: f"@{_LEGACY_TRAINER}"} if legacy else {}
        if not isinstance(raw, Mapping):
            raise JobConfigError(
                f"job_data 'executors' must be an object (task name -> '@name'), not {raw!r}"
            )
        return raw


def outline_job_data(job_data: str | bytes | Mapping[str, Any]) -> JobOutline:
    """Parses ``job_data`` and checks what needs nothing built: its keys, every component's entry,
    unique names, that every ``@ref`` in args names a component, and that references have no cycle.

    Raises:
        JobConfigError: The first problem found; the message names the entry.
    """
    doc = _parse(job_data)
    return JobOutline(
        document=doc, components=tuple(_dependency_order(_component_specs(doc.get("components"))))
    )


def process_job_data(
    job_data: str | bytes | Mapping[str, Any],
    registry: ResolverRegistry | None = None,
    *,
    allow_components: Sequence[str] = (),
) -> JobConfig:
    """Parse and build a job config.

    Args:
        job_data: The JSON document (``str``/``bytes``) or the parsed object.
        registry: The app's resolvers; they override the built-ins of the same type name.
        allow_components: ``fnmatch`` patterns of the modules from which a type neither registry has
            may be imported (``pkg.module:Name``); none by default.

    Returns:
        The built :class:`JobConfig`.

    Raises:
        ComponentNotAllowed: An import-path type from a module the patterns do not allow.
        JobConfigError: Invalid JSON, a wrong shape, an unknown type, a missing or cyclic reference,
            a duplicate name, a constructor that rejects its args, or a filter/executor/handler
            reference to a component of the wrong kind. The message names the offending entry.
    """
    outline = outline_job_data(job_data)
    resolvers = _builtins().merged(registry)
    components: dict[str, object] = {}
    for spec in outline.components:
        components[spec.name] = _build(spec, resolvers, components, tuple(allow_components))

    doc = outline.document
    executors = _executors(outline, components)
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


def _component_specs(raw: object) -> list[ComponentSpec]:
    if not isinstance(raw, list):
        raise JobConfigError(f"job_data 'components' must be a list, not {type(raw).__name__}")
    specs: dict[str, ComponentSpec] = {}
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
        refs = tuple(dict.fromkeys(_refs_in(args)))
        specs[name] = ComponentSpec(entry["type"], name, dict(args), refs)
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


def _dependency_order(specs: list[ComponentSpec]) -> list[ComponentSpec]:
    """Depth-first topological order, declaration order among independent components."""
    by_name = {spec.name: spec for spec in specs}
    done: set[str] = set()
    order: list[ComponentSpec] = []
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


def _build(
    spec: ComponentSpec,
    resolvers: ResolverRegistry,
    built: Mapping[str, object],
    allow_components: tuple[str, ...],
) -> object:
    where = f"component {spec.name!r} (type {spec.type!r})"
    if spec.type in resolvers:
        factory = resolvers.get(spec.type)
    elif is_import_path(spec.type):
        factory = load_component_type(spec.type, allow_components, component=spec.name)
    else:
        raise JobConfigError(
            f"component {spec.name!r} has unknown type {spec.type!r}{did_you_mean(spec.type, resolvers)}; "
            f"known types: {', '.join(resolvers)}, or an app's own as pkg.module:Name"
        )
    args = _substitute(spec.args, built)
    try:
        if isinstance(factory, type) and issubclass(factory, ComponentResolver):
            return factory(spec.type, spec.name, args).resolve()
        check_args(factory, args, where)
        return factory(**args)
    except JobConfigError:
        raise
    except (TypeError, ValueError, FedlinkError) as exc:
        raise JobConfigError(f"{where} rejected its args: {exc}") from exc


def did_you_mean(type_name: str, known: Iterable[str]) -> str:
    """``" (did you mean 'X'?)"`` for the known type closest to a misspelt ``type_name``, else ""."""
    names = list(known)
    by_case = {name.lower(): name for name in names}
    if type_name.lower() in by_case:
        return f" (did you mean {by_case[type_name.lower()]!r}?)"
    if "." in type_name and ":" not in type_name:  # mypkg.mod.Trainer for mypkg.mod:Trainer
        module, _, attribute = type_name.rpartition(".")
        return f" (did you mean {module + ':' + attribute!r}?)"
    close = difflib.get_close_matches(type_name, names, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---- import-path types -------------------------------------------------------------------------------


def is_import_path(type_name: str) -> bool:
    """Whether a type is spelled as an import path (it has a colon); its form is checked on loading."""
    return ":" in type_name


def split_import_path(type_name: str) -> tuple[str, str]:
    """``"pkg.module:Name"`` as its module and attribute.

    Raises:
        JobConfigError: Not of that form.
    """
    if not _IMPORT_PATH.fullmatch(type_name):
        raise JobConfigError(
            f"component type {type_name!r} is not a built-in type's name nor an import path of the form "
            "pkg.module:Name"
        )
    module, _, attribute = type_name.partition(":")
    return module, attribute


def module_allowed(module: str, patterns: Sequence[str]) -> bool:
    """Whether an ``fnmatch`` pattern of ``patterns`` matches the module's full name; ``pkg.*`` also
    matches ``pkg`` itself (the package and everything under it)."""
    return any(
        fnmatch.fnmatchcase(module, pattern) or (pattern.endswith(".*") and module == pattern[:-2])
        for pattern in patterns
    )


def _not_allowed(subject: str, module: str, patterns: Sequence[str]) -> ComponentNotAllowed:
    allowed = ", ".join(repr(p) for p in patterns) if patterns else "nothing"
    top = module.split(".")[0]
    return ComponentNotAllowed(
        f"{subject}, which this runner does not allow (its {ALLOW_COMPONENTS} setting allows {allowed}). "
        f"That is code chosen by whoever submitted the job; to run it, the device's owner adds "
        f"{module!r} or a pattern such as '{top}.*' to {ALLOW_COMPONENTS} (--allow-components, the "
        f"runner's TOML or FEDLINK_{ALLOW_COMPONENTS.upper()})"
    )


def load_component_type(type_name: str, allow_components: Sequence[str], *, component: str = "") -> Factory:
    """The class or factory an import-path type names, imported only from an allowed module.

    Args:
        type_name: ``pkg.module:Name``.
        allow_components: ``fnmatch`` patterns of the modules that may be imported (``"*"``: any).
        component: The component's name, for the messages.

    Raises:
        ComponentNotAllowed: The module, or the one the object is defined in, is not allowed (checked
            before anything is imported).
        JobConfigError: Not of the form, the module cannot be imported, or it has no such class or
            factory.
    """
    what = f"component {component!r} has type {type_name!r}" if component else f"type {type_name!r} is"
    module_name, attribute = split_import_path(type_name)
    if not module_allowed(module_name, allow_components):
        raise _not_allowed(f"{what} from module {module_name!r}", module_name, allow_components)
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # an ImportError, or whatever the module's own code raised
        raise JobConfigError(
            f"{what}: cannot import module {module_name!r}: {type(exc).__name__}: {exc} (is it installed, "
            "or on the runner's PYTHONPATH?)"
        ) from None
    for part in attribute.split("."):
        # Private and dunder names (``__globals__``, ``__class__``...) would lead anywhere.
        found = None if part.startswith("_") else getattr(target, part, None)
        if found is None or isinstance(found, types.ModuleType):
            # Through a module the allowed one imported, anything would be reachable.
            raise JobConfigError(
                f"{what}: module {module_name!r} has no public class or factory {attribute!r}"
            )
        target = found
    # A class or function an allowed module imported from elsewhere is that other module's code.
    defined_in = getattr(target, "__module__", None)
    if (
        (inspect.isclass(target) or inspect.isroutine(target))
        and isinstance(defined_in, str)
        and defined_in != module_name
        and not module_allowed(defined_in, allow_components)
    ):
        raise _not_allowed(f"{what}, defined in module {defined_in!r}", defined_in, allow_components)
    if not callable(target):
        raise JobConfigError(f"{what}: {attribute!r} of {module_name!r} is not a class or factory")
    factory: Factory = target
    return factory


@functools.cache
def _builtins() -> ResolverRegistry:
    """The built-in types, checked once (``merged`` copies them: this one is never changed)."""
    # Imported here: the built-ins import the spec, and the spec must not import the config.
    from fedlink.runner.builtins import builtin_registry

    return builtin_registry()


#: Each factory's signature while the factory lives: a class without an __init__ of its own has its
#: signature parsed from text (tokenize, compile), ~100 us, and a simulation builds each device's
#: components (10,000 times). Weak keys: a factory closing over a model (a registry entry made per job)
#: is not kept alive, with its model, by this cache.
_SIGNATURES: weakref.WeakKeyDictionary[Factory, inspect.Signature | None] = weakref.WeakKeyDictionary()


def _parse_signature(factory: Factory) -> inspect.Signature | None:
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins and C types have no signature
        return None


def _signature_of(factory: Factory) -> inspect.Signature | None:
    try:
        return _SIGNATURES[factory]
    except KeyError:
        signature = _SIGNATURES[factory] = _parse_signature(factory)
        return signature
    except TypeError:  # unhashable, or no weak reference to it: not cached
        return _parse_signature(factory)


def check_args(factory: Factory, args: Mapping[str, Any], where: str) -> None:
    """Checks that ``factory`` accepts ``args`` by name (without calling it).

    Raises:
        JobConfigError: An arg it does not take, or a required one missing; names ``where``.
    """
    # Binding first turns "__init__() got an unexpected keyword argument" into a message naming
    # the component, and keeps TypeErrors raised inside a constructor distinguishable.
    signature = _signature_of(factory)
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


def _executors(outline: JobOutline, components: Mapping[str, object]) -> dict[str, Executor]:
    executors: dict[str, Executor] = {}
    for task_name, ref in outline.executor_refs().items():
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
