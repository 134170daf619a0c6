"""JSON documents from the wire, read with bounded size and nesting.

``json.loads`` recurses once per level of nesting: a document nested 10,000 deep raises RecursionError
(an INTERNAL error where the sender is at fault), and deep nesting costs stack and time before that. A
document a peer sent is therefore measured before it is parsed: its length, and its depth, counted
over its brackets outside string literals, without recursion.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final, NoReturn

import numpy as np

from fedlink.common.errors import InvalidArgument

__all__ = ["MAX_JSON_DEPTH", "json_depth", "load_json"]

MAX_JSON_DEPTH: Final[int] = 64
"""Deepest nesting of arrays and objects accepted in a JSON document (a DXO's meta value, job_data)."""

# A string literal: quotes around anything but quotes and backslashes, or escapes (unrolled, no
# backtracking). An unterminated literal does not match, and its brackets count: such text is no JSON.
_STRING: Final = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STEP: Final = np.zeros(256, np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in ``text`` (0 for a scalar), without parsing it."""
    outside = _STRING.sub("", text).encode()
    steps = _STEP[np.frombuffer(outside, np.uint8)]
    return max(int(np.cumsum(steps, dtype=np.int64).max(initial=0)), 0)


def load_json(
    text: str,
    *,
    what: str,
    max_bytes: int | None = None,
    max_depth: int = MAX_JSON_DEPTH,
    strict: bool = True,
) -> Any:
    """Parses JSON after checking its size and depth.

    Args:
        text: The document.
        what: What the document is, for messages (``"job_data"``, ``"meta 'labels': json_value"``).
        max_bytes: Refuse a document longer than this many UTF-8 bytes; None: no bound here.
        max_depth: Refuse a document whose arrays and objects nest deeper than this.
        strict: Refuse ``NaN`` and ``Infinity``, which are not JSON (Python's json writes them).

    Raises:
        InvalidArgument: The document is too long, too deep, or not valid JSON, naming the limit.
    """
    if max_bytes is not None and len(text) > max_bytes // 4:  # shorter text cannot be too long
        size = len(text.encode())
        if size > max_bytes:
            raise InvalidArgument(f"{what} is {size} bytes, more than the limit of {max_bytes} bytes")
    # Fewer brackets than the limit cannot nest deeper: most documents need no scan.
    if text.count("[") + text.count("{") > max_depth and (depth := json_depth(text)) > max_depth:
        raise InvalidArgument(
            f"{what} nests arrays and objects {depth} deep, more than the limit of {max_depth}"
        )
    try:
        if strict:
            return json.loads(text, parse_constant=_reject_constant)
        return json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from None


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")
