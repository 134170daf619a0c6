"""Ids are UUIDv7 hex: well-formed, unique, and ordered by the millisecond they were made in."""

from __future__ import annotations

import time
import uuid

from fedlink.server.domain import new_id


def test_ids_are_uuid7_hex_with_the_time_in_front() -> None:
    before = time.time_ns() // 1_000_000
    made = new_id()
    after = time.time_ns() // 1_000_000
    assert len(made) == 32 and made == made.lower() and int(made, 16) >= 0
    parsed = uuid.UUID(made)
    assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
    assert before <= int(made[:12], 16) <= after


def test_ids_are_unique_and_later_ones_sort_later() -> None:
    first = [new_id() for _ in range(10_000)]
    assert len(set(first)) == len(first)
    time.sleep(0.002)  # a later millisecond
    later = new_id()
    assert later > max(first)
