"""Workflow parameters as frozen dataclasses, read from and written to JSON configs and job-file tables.

A built-in workflow's parameters are a frozen dataclass whose fields are its config keys (the JSON
document a job stores, and the keys of its job-file section). :class:`WorkflowParams` gives every such
class one way to be read, checked and written, so the job file, the wire mapping, the simulation and
the coordinator all agree on what a parameter means:

- :meth:`WorkflowParams.from_config` reads a JSON config (unknown keys, wrong types and values out of
  range are an :class:`~fedlink.common.errors.InvalidArgument` naming the key);
- :meth:`WorkflowParams.from_table` reads a job-file section, where a duration may be written
  ``"90s"`` under the key without the ``_s`` of its field (``round_timeout = "90s"`` for
  ``round_timeout_s``);
- :meth:`WorkflowParams.to_config` writes every field, defaults included, so a stored job says exactly
  what ran whatever later releases change.

A class's ``__post_init__`` checks value ranges; its messages start with the field's name, and the
readers put the workflow's name in front (``"fedavg.num_rounds must be at least 1"``).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Self

from fedlink.common.errors import InvalidArgument
from fedlink.server.settings import parse_duration

#: Field metadata key marking a float field of seconds that a job file may write as a duration.
DURATION = "duration"
_INT64 = (-(2**63), 2**63 - 1)


def seconds_field(default: float, **kwargs: Any) -> Any:
    """A float field of seconds, written in a job file as a duration under its name without ``_s``."""
    return dataclasses.field(default=default, metadata={DURATION: True}, **kwargs)


class WorkflowParams:
    """Mixin of the frozen dataclasses that hold a built-in workflow's parameters."""

    __slots__ = ()

    #: Pairs of keys a job file may not set together (the second one wins otherwise, silently).
    exclusive_keys: ClassVar[tuple[tuple[str, str], ...]] = ()

    @classmethod
    def from_config(cls, config: Mapping[str, object], *, section: str) -> Self:
        """Reads a JSON config; ``section`` (the workflow's name) prefixes the messages.

        Raises:
            InvalidArgument: an unknown or missing key, a value of the wrong type or out of range.
        """
        kinds = _schema(cls).kinds
        unknown = sorted(set(config) - set(kinds))
        if unknown:
            raise InvalidArgument(
                f"unknown key(s) in {section}: {', '.join(unknown)}; allowed: {', '.join(kinds)}"
            )
        missing = [name for name in _schema(cls).required if name not in config]
        if missing:
            raise InvalidArgument(f"{section}.{missing[0]} is missing")
        values = {key: _coerce(kinds[key], value, f"{section}.{key}") for key, value in config.items()}
        try:
            return cls(**values)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{section}.{exc.message}") from None

    @classmethod
    def from_table(cls, table: Mapping[str, object], *, section: str) -> Self:
        """Reads a job-file section: durations by their short key (``round_timeout = "90s"``).

        Raises:
            InvalidArgument: as :meth:`from_config`, and for keys set together that exclude each other.
        """
        for first, second in cls.exclusive_keys:
            if first in table and second in table:
                raise InvalidArgument(f"{section} takes {first} or {second}, not both")
        durations = {name.removesuffix("_s"): name for name in _schema(cls).durations}
        config: dict[str, object] = {}
        for key, value in table.items():
            if key in durations:
                if isinstance(value, bool):
                    raise InvalidArgument(f"{section}.{key} must be a duration such as '60s', not {value!r}")
                try:
                    config[durations[key]] = parse_duration(value).total_seconds()
                except InvalidArgument as exc:
                    raise InvalidArgument(f"{section}.{key}: {exc.message}") from None
            elif key in _schema(cls).durations:
                raise InvalidArgument(f"{section}: write {key} as {key.removesuffix('_s')} = '60s'")
            else:
                config[key] = value
        return cls.from_config(config, section=section)

    @classmethod
    def field_names(cls) -> frozenset[str]:
        """The config keys these parameters have."""
        return frozenset(_schema(cls).kinds)

    def to_config(self) -> dict[str, Any]:
        """Every field as JSON values, defaults included."""
        assert dataclasses.is_dataclass(self)
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def num_steps(self) -> int:
        """How many rounds (or model versions) the job runs to; 0 if the parameters do not say."""
        return 0

    def time_bound_s(self) -> float | None:
        """The longest a run can take when every step runs to its timeout; None if unbounded."""
        return None

    @property
    def task_names(self) -> tuple[str, ...] | None:
        """The names of the tasks the workflow sends (each needs an executor); None if not known."""
        return None

    def check_memory(self, *, model_bytes: int, max_buffered_round_bytes: int) -> None:
        """Refuses parameters whose run would hold more updates in memory than the coordinator allows.

        Raises:
            InvalidArgument: naming the limit.
        """

    def with_seed(self, seed: int) -> Self:
        """These parameters with ``seed`` as the sampling seed (unchanged if they have none)."""
        if "seed" not in _schema(type(self)).kinds:
            return self
        assert dataclasses.is_dataclass(self)
        return typing.cast(Self, dataclasses.replace(self, seed=seed))


# ---- field kinds ------------------------------------------------------------------------------------

_Kind = type | tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Schema:
    """What the readers need to know of a parameters class, worked out once per class."""

    #: Each field's JSON kind: bool, int, float, str, or the tuple of a Literal's choices.
    kinds: dict[str, _Kind]
    #: Fields without a default.
    required: tuple[str, ...]
    #: Float fields of seconds that a job file writes as durations.
    durations: frozenset[str]

    @classmethod
    def of(cls, params: type[Any]) -> _Schema:
        hints = typing.get_type_hints(params)
        kinds: dict[str, _Kind] = {}
        for f in dataclasses.fields(params):
            hint = hints[f.name]
            if typing.get_origin(hint) is Literal:
                kinds[f.name] = tuple(str(choice) for choice in typing.get_args(hint))
            elif hint in (bool, int, float, str):
                kinds[f.name] = hint
            else:  # pragma: no cover - a new parameter type needs a rule here
                raise TypeError(
                    f"{params.__name__}.{f.name}: parameters are bool, int, float, str or Literal"
                )
        missing = dataclasses.MISSING
        return cls(
            kinds=kinds,
            required=tuple(
                f.name
                for f in dataclasses.fields(params)
                if f.default is missing and f.default_factory is missing
            ),
            durations=frozenset(f.name for f in dataclasses.fields(params) if f.metadata.get(DURATION)),
        )


_SCHEMAS: dict[type[Any], _Schema] = {}


def _schema(params: type[Any]) -> _Schema:
    found = _SCHEMAS.get(params)
    if found is None:
        found = _SCHEMAS[params] = _Schema.of(params)
    return found


def _coerce(kind: _Kind, value: object, key: str) -> object:
    if isinstance(kind, tuple):
        if isinstance(value, str) and value in kind:
            return value
        raise InvalidArgument(f"{key} must be one of {', '.join(repr(c) for c in kind)}, not {value!r}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise InvalidArgument(f"{key} must be true or false, not {value!r}")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not _INT64[0] <= value <= _INT64[1]:
                raise InvalidArgument(f"{key} must fit in 64 bits, not {value}")
            return value
        if isinstance(value, float) and value.is_integer():  # JSON writers that only know doubles
            return int(value)
        raise InvalidArgument(f"{key} must be a whole number, not {value!r}")
    if kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise InvalidArgument(f"{key} must be a finite number, not {value!r}")
            return float(value)
        raise InvalidArgument(f"{key} must be a number, not {value!r}")
    if isinstance(value, str):
        return value
    raise InvalidArgument(f"{key} must be a string, not {value!r}")
