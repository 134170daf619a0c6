"""Parsing a large serialized message a slice of its top-level fields at a time.

The protobuf runtime parses a message in one C call that holds the GIL: 40 to 80 ms for a DXO of
100,000 small tensors, during which no other thread of the process runs Python (an event loop
included). A serialized message is the concatenation of its fields, and parsing a concatenation is
merging the parts (the protobuf rule: a repeated map key replaces, a scalar's last value wins, a
message field merges), so the same message is built by merging slices cut between top-level fields,
with the GIL free to change hands between them. Cutting needs only each top-level field's tag and
length, read here without decoding anything.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Final

from google.protobuf.message import Message

__all__ = ["SLICE_BYTES", "count_fields", "field_cuts", "merge_in_slices"]

#: About how many bytes one slice holds (a single larger field is a slice of its own).
SLICE_BYTES: Final[int] = 256 * 1024

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def field_cuts(data: bytes | memoryview, every: int = SLICE_BYTES) -> list[int] | None:
    """Offsets from 0 to ``len(data)`` that fall between top-level fields, about ``every`` bytes apart.

    Returns None for bytes this scan does not follow (a group, a truncated field, an overlong varint):
    parse those whole, and the runtime says what is wrong with them.
    """
    cuts = [0]
    next_cut = every
    try:
        for _, end in _top_level_fields(data):
            if end >= next_cut:
                cuts.append(end)
                next_cut = end + every
    except _Unfollowed:
        return None
    if cuts[-1] != len(data):
        cuts.append(len(data))
    return cuts


def count_fields(data: bytes | memoryview, number: int, stop_after: int) -> int | None:
    """How many top-level fields ``number`` the serialized message holds (each entry of a map field is
    one), counting no further than ``stop_after + 1``: a message with more entries than a limit is
    known to have them without reading the rest. None for bytes the scan does not follow (see
    :func:`field_cuts`).
    """
    count = 0
    try:
        for field, _ in _top_level_fields(data):
            if field == number:
                count += 1
                if count > stop_after:
                    return count
    except _Unfollowed:
        return None
    return count


class _Unfollowed(Exception):
    """Bytes the scan does not follow (a group, a truncated field, an overlong varint)."""


def _top_level_fields(data: bytes | memoryview) -> Iterator[tuple[int, int]]:
    """Each top-level field's number and the offset just after it, read from tags and lengths alone.

    Raises:
        _Unfollowed: at the first field the scan does not follow.
    """
    n = len(data)
    pos = 0
    while pos < n:
        key, pos = _varint(data, pos, n)
        if pos < 0:
            raise _Unfollowed
        wire_type = key & 7
        if wire_type == _LEN:
            length, pos = _varint(data, pos, n)
            if pos < 0:
                raise _Unfollowed
            pos += length
        elif wire_type == _VARINT:
            _, pos = _varint(data, pos, n)
            if pos < 0:
                raise _Unfollowed
        elif wire_type == _I64:
            pos += 8
        elif wire_type == _I32:
            pos += 4
        else:
            raise _Unfollowed
        if pos > n:
            raise _Unfollowed
        yield key >> 3, pos


def _varint(data: bytes | memoryview, pos: int, n: int) -> tuple[int, int]:
    """The varint at ``pos`` and the offset after it; (0, -1) if it is truncated or overlong."""
    result = shift = 0
    while pos < n and shift < 70:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
    return 0, -1


def merge_in_slices(message: Message, data: bytes, every: int = SLICE_BYTES) -> None:
    """Merges serialized ``data`` into ``message`` as ``message.MergeFromString(data)`` would, a slice of
    about ``every`` bytes at a time when the bytes are larger than that.

    Raises:
        google.protobuf.message.DecodeError: As ``MergeFromString``.
    """
    cuts = field_cuts(data, every) if len(data) > every else None
    if cuts is None:
        message.MergeFromString(data)
        return
    view = memoryview(data)
    for start, end in itertools.pairwise(cuts):
        message.MergeFromString(view[start:end])  # type: ignore[arg-type]  # any buffer will do
