"""Ids are UUIDv7 hex: well-formed, unique, and ordered by the millisecond they were made in."""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

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


def test_a_forked_child_makes_ids_of_its_own() -> None:
    new_id()  # the parent has random bytes left over
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        os.write(write, new_id().encode())
        os._exit(0)
    os.close(write)
    child = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert len(child) == 32 and child[12:] != new_id()[12:]


def test_threads_making_ids_together_never_share_one() -> None:
    with ThreadPoolExecutor(max_workers=8) as pool:
        batches = list(pool.map(lambda _: [new_id() for _ in range(5_000)], range(8)))
    made = [i for batch in batches for i in batch]
    assert len(set(made)) == len(made) == 40_000
