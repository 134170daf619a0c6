"""What can be checked in a job's ``job_data`` without building a component or importing an app's code.

The coordinator runs :func:`check_job_data` on every submission (and ``fedlink job submit`` and
``fedlink simulate`` run it before uploading anything), so that a broken runner configuration is
refused at once instead of failing on every device. It checks:

* the document's shape, unique names, that every ``"@name"`` reference names a component, and that
  references have no cycle (:func:`~fedlink.runner.config.outline_job_data`);
* every component's ``type``: a built-in type's name (a misspelt one gets a "did you mean"), an import
  path of the form ``pkg.module:Name``, or a type the caller says the devices know (``known_types``:
  an app's own registered names, as ``fnmatch`` patterns; ``fedlink job submit`` passes ``"*"``, as
  only the coordinator knows its ``component_types``, and leaves the names to it);
* a built-in type's args by name (one it does not take, or a required one missing);
* ``executors``, ``in_filters``, ``out_filters`` and ``handlers``: references to declared components,
  of the right kind where the type is a built-in one;
* that every task the workflow sends (``task_names``) has an executor, or ``"*"`` does.

What it cannot know is left to the device: whether an import path's module exists there and is
allowed (``fedlink runner --allow-components``), what an app's own type accepts, and whether a file
exists on the device.

:func:`resolve_paths` makes the relative file paths of the built-in data sources' args relative to a
job file's folder, as the job's model path is.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from fedlink.runner.config import (
    ANY_TASK,
    ComponentSpec,
    Factory,
    JobConfigError,
    JobOutline,
    check_args,
    did_you_mean,
    is_import_path,
    outline_job_data,
    split_import_path,
)
from fedlink.runner.spec import EventHandler, Executor, Filter

__all__ = ["BUILTIN_PATH_ARGS", "check_job_data", "job_data_problems", "resolve_paths"]

#: The args of built-in types that are file paths (resolved against the job file when relative).
BUILTIN_PATH_ARGS: Final[Mapping[str, tuple[str, ...]]] = {
    "NpzDataSource": ("path",),
    "CsvDataSource": ("train", "valid", "test"),
}
_KINDS: Final[Mapping[str, tuple[type, str]]] = {
    "executors": (Executor, "an Executor"),
    "in_filters": (Filter, "a Filter"),
    "out_filters": (Filter, "a Filter"),
    "handlers": (EventHandler, "an EventHandler"),
}


@functools.cache
def _builtin_types() -> Mapping[str, Factory]:
    # Imported here: the built-ins import the executors and filters, which import the spec.
    from fedlink.runner.builtins import BUILTIN_TYPES

    return BUILTIN_TYPES


def check_job_data(
    job_data: str | bytes | Mapping[str, Any],
    *,
    task_names: Sequence[str] | None = None,
    known_types: Sequence[str] = (),
    workflow: str = "the workflow",
    known_types_hint: str = "",
) -> JobOutline:
    """Checks ``job_data`` as far as it can be without building it (see the module docstring).

    Args:
        job_data: The JSON document or the parsed object.
        task_names: The tasks the job's workflow sends, each of which needs an executor; None when
            they are not known (a workflow of one's own).
        known_types: ``fnmatch`` patterns of type names the devices' apps register themselves.
        workflow: What sends the tasks, for the message (``"the fedavg workflow"``).
        known_types_hint: Where ``known_types`` come from, said with an unknown type (``"or a name
            listed in the coordinator's component_types setting"``).

    Returns:
        The outline, when there is no problem.

    Raises:
        JobConfigError: Every problem found, in one message.
    """
    try:
        outline = outline_job_data(job_data)
    except JobConfigError as exc:
        said = exc.message if exc.message.startswith("job_data") else f"job_data: {exc.message}"
        raise JobConfigError(said) from None
    problems = job_data_problems(
        outline,
        task_names=task_names,
        known_types=known_types,
        workflow=workflow,
        known_types_hint=known_types_hint,
    )
    if len(problems) == 1:
        raise JobConfigError(f"job_data: {problems[0]}")
    if problems:
        listed = "; ".join(f"({i}) {problem}" for i, problem in enumerate(problems, 1))
        raise JobConfigError(f"job_data has {len(problems)} problems: {listed}")
    return outline


def job_data_problems(
    outline: JobOutline,
    *,
    task_names: Sequence[str] | None = None,
    known_types: Sequence[str] = (),
    workflow: str = "the workflow",
    known_types_hint: str = "",
) -> list[str]:
    """The problems :func:`check_job_data` reports, one message each (empty: none)."""
    problems: list[str] = []
    kinds: dict[str, type | None] = {}  # component name -> its built-in class, None if not built-in
    for spec in outline.components:
        kinds[spec.name] = _check_type(spec, known_types, known_types_hint, problems)
    try:
        executors = outline.executor_refs()
    except JobConfigError as exc:
        problems.append(exc.message)
        executors = {}
    for task_name, ref in executors.items():
        problems.extend(_reference(f"executors[{task_name!r}]", ref, "executors", kinds))
    for key in ("in_filters", "out_filters", "handlers"):
        raw = outline.document.get(key, [])
        if not isinstance(raw, list):
            problems.append(f"{key!r} must be a list of '@name' references, not {raw!r}")
            continue
        for index, ref in enumerate(raw):
            problems.extend(_reference(f"{key}[{index}]", ref, key, kinds))
    if task_names is not None and ANY_TASK not in executors:
        listed = ", ".join(repr(name) for name in executors) or "none"
        problems.extend(
            f"no executor for task {task_name!r}, which {workflow} sends (executors: {listed}); "
            'map it, or "*", to an executor component'
            for task_name in task_names
            if task_name not in executors
        )
    return problems


def _check_type(
    spec: ComponentSpec, known_types: Sequence[str], hint: str, problems: list[str]
) -> type | None:
    """Adds the problems of one component's type and args; returns its built-in class, if it has one."""
    where = f"component {spec.name!r} (type {spec.type!r})"
    builtins = _builtin_types()
    factory = builtins.get(spec.type)
    if factory is not None:
        try:
            check_args(factory, spec.args, where)
        except JobConfigError as exc:
            problems.append(exc.message)
        return factory if isinstance(factory, type) else None
    if is_import_path(spec.type):
        try:
            _, attribute = split_import_path(spec.type)
        except JobConfigError as exc:
            problems.append(f"component {spec.name!r}: {exc.message}")
            return None
        if any(part.startswith("_") for part in attribute.split(".")):
            problems.append(f"{where}: a type's name cannot be private (start with '_')")
        return None
    if not any(fnmatch.fnmatchcase(spec.type, pattern) for pattern in known_types):
        problems.append(
            f"component {spec.name!r} has unknown type {spec.type!r}"
            f"{did_you_mean(spec.type, [*builtins, *known_types])}; a type is a built-in one "
            f"({', '.join(sorted(builtins))}) or an app's own as pkg.module:Name"
            + (f", {hint}" if hint else "")
        )
    return None  # else the devices' apps build it: nothing more is known here


def _reference(where: str, ref: object, key: str, kinds: Mapping[str, type | None]) -> list[str]:
    if not isinstance(ref, str) or not ref.startswith("@"):
        return [f"{where} must be a reference like '@name', not {ref!r}"]
    name = ref[1:]
    if name not in kinds:
        declared = ", ".join(repr(n) for n in kinds) or "none"
        return [f"{where} references undefined component {ref!r} (components: {declared})"]
    cls = kinds[name]
    protocol, what = _KINDS[key]
    if cls is not None and not issubclass(cls, protocol):
        return [f"{where} = {ref!r} is a {cls.__name__}, not {what}"]
    return []


def resolve_paths(document: Mapping[str, Any], base: Path) -> tuple[dict[str, Any], list[tuple[str, Path]]]:
    """``document`` with the relative file paths of built-in data sources made relative to ``base``.

    Args:
        document: A parsed ``job_data`` (not changed).
        base: The folder of the job file.

    Returns:
        The new document, and ``(where, path)`` of each path it resolved, so that the caller, which
        can see those files, can say which one is missing. Absolute paths are paths on the devices
        and are left as they are.
    """
    resolved: list[tuple[str, Path]] = []
    components = document.get("components")
    if not isinstance(components, list):
        return dict(document), resolved
    new_components: list[Any] = []
    for index, entry in enumerate(components):
        path_args = BUILTIN_PATH_ARGS.get(entry.get("type", "")) if isinstance(entry, Mapping) else None
        args = entry.get("args") if isinstance(entry, Mapping) else None
        if not path_args or not isinstance(args, Mapping):
            new_components.append(entry)
            continue
        new_args = dict(args)
        for arg in path_args:
            value = args.get(arg)
            if (
                isinstance(value, str)
                and value
                and not value.startswith("@")
                and not Path(value).is_absolute()
            ):
                path = base / value
                new_args[arg] = str(path)
                resolved.append((f"components[{index}] ({entry.get('name')!r}) args.{arg}", path))
        new_components.append({**entry, "args": new_args})
    return {**document, "components": new_components}, resolved
