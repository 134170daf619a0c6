"""``google.protobuf.Duration`` fields of requests: checked in range, read as timedeltas.

A Duration holds seconds in ±315,576,000,000 (10,000 years) and nanos of the same sign below 10⁹;
protobuf does not check that when it parses, and ``ToTimedelta`` raises OverflowError beyond what a
timedelta holds (INTERNAL, with a traceback in the log per call). So every request is checked before
its method runs (:func:`duration_paths` once per method, :func:`check_durations` per call): a Duration
out of range anywhere in it is INVALID_ARGUMENT naming the field, and servicers convert what passed
with :func:`duration_field`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Final

from google.protobuf import duration_pb2
from google.protobuf.descriptor import Descriptor
from google.protobuf.message import Message

from fedlink.common.errors import InvalidArgument

__all__ = ["MAX_DURATION_SECONDS", "check_durations", "duration_field", "duration_paths", "to_timedelta"]

MAX_DURATION_SECONDS: Final[int] = 315_576_000_000
"""The largest number of seconds a valid Duration holds (and its negation the smallest)."""
_NANOS: Final[int] = 1_000_000_000
_DURATION: Final = duration_pb2.Duration.DESCRIPTOR.full_name
#: A Duration field's place in a request: the names of the singular message fields leading to it.
DurationPath = tuple[str, ...]


def duration_paths(descriptor: Descriptor) -> tuple[DurationPath, ...]:
    """Where a message of this type can hold a Duration, through singular message fields (repeated and
    map fields are not followed: no request holds a Duration in one)."""
    found: list[DurationPath] = []

    def walk(message: Descriptor, path: DurationPath, seen: frozenset[str]) -> None:
        for field in message.fields:
            inner = field.message_type
            if inner is None or field.is_repeated:
                continue
            if inner.full_name == _DURATION:
                found.append((*path, field.name))
            elif inner.full_name not in seen:
                walk(inner, (*path, field.name), seen | {inner.full_name})

    walk(descriptor, (), frozenset({descriptor.full_name}))
    return tuple(found)


def check_durations(message: Message, paths: Sequence[DurationPath]) -> None:
    """Checks every Duration set at ``paths`` of ``message`` (see :func:`duration_paths`).

    Raises:
        InvalidArgument: One is out of range, naming it (``spec.fedavg.round_timeout``).
    """
    for path in paths:
        current = message
        for name in path:
            if not current.HasField(name):
                break
            current = getattr(current, name)
        else:
            assert isinstance(current, duration_pb2.Duration)
            to_timedelta(current, ".".join(path))


def duration_field(message: Message, name: str) -> timedelta | None:
    """The Duration field ``name`` of ``message`` as a timedelta, or None when it is not set.

    Raises:
        InvalidArgument: The value is outside a Duration's range.
    """
    if not message.HasField(name):
        return None
    value = getattr(message, name)
    assert isinstance(value, duration_pb2.Duration), f"{name} is not a Duration field"
    return to_timedelta(value, name)


def to_timedelta(value: duration_pb2.Duration, name: str) -> timedelta:
    """``value`` as a timedelta (rounded toward zero to microseconds).

    Raises:
        InvalidArgument: ``value`` is outside a Duration's range, naming the field ``name``.
    """
    seconds, nanos = value.seconds, value.nanos
    if (
        abs(seconds) > MAX_DURATION_SECONDS
        or abs(nanos) >= _NANOS
        or (seconds > 0 and nanos < 0)
        or (seconds < 0 and nanos > 0)
    ):
        raise InvalidArgument(
            f"{name} is out of range ({seconds}s {nanos}ns): a Duration holds at most "
            f"±{MAX_DURATION_SECONDS} seconds, and nanos of the same sign below {_NANOS}"
        )
    return value.ToTimedelta()
