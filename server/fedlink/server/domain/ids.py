"""Identifiers: UUIDv7 (RFC 9562) as 32 lowercase hex characters.

The first 48 bits are the creation time in milliseconds, the rest random (74 bits of it). Ids made
later sort later, so the store's primary-key indexes grow at their end instead of taking each new row
at a random page: inserting a 10,000-device round's tasks, targets and offers took about a third less
time than with uuid4 ids. Nothing reads meaning into an id's order; it only helps the indexes.
"""

from __future__ import annotations

import os
import threading
import time

_VERSION_7 = 0x7 << 76
_VARIANT = 0b10 << 62
_RAND_A = (1 << 12) - 1
_RAND_B = (1 << 62) - 1


_RANDOM_BYTES = 10
_POOL_BYTES = 4000  # 400 ids per read of the OS's entropy
_pool = b""
_used = 0
_lock = threading.Lock()  # ids are made on the event loop and in the store's threads


def _refill_after_fork() -> None:
    global _pool, _used, _lock  # a child must never hand out its parent's remaining random bytes
    _pool, _used, _lock = b"", 0, threading.Lock()


os.register_at_fork(after_in_child=_refill_after_fork)


def _random_bits() -> int:
    """80 random bits from the OS, read 4,000 bytes at a time: os.urandom releases the GIL, and a
    round's 10,000 ids had each waited to get it back from the store's thread."""
    global _pool, _used
    with _lock:
        if _used + _RANDOM_BYTES > len(_pool):
            _pool, _used = os.urandom(_POOL_BYTES), 0
        start = _used
        _used = start + _RANDOM_BYTES
        return int.from_bytes(_pool[start : start + _RANDOM_BYTES])


def new_id() -> str:
    """Return a fresh identifier: a UUIDv7's 32 hex digits (time-ordered to the millisecond)."""
    random = _random_bits()
    millis = time.time_ns() // 1_000_000
    value = (millis << 80) | _VERSION_7 | ((random >> 62) & _RAND_A) << 64 | _VARIANT | (random & _RAND_B)
    return f"{value:032x}"
