"""KnownTasks keeps the latest tasks by id, up to its limit."""

from __future__ import annotations

from collections import OrderedDict
from datetime import UTC, datetime

from fedlink.server.coordination.known_tasks import KnownTasks, remember
from fedlink.server.domain import Task, TaskState


def _task(task_id: str) -> Task:
    when = datetime(2026, 11, 30, tzinfo=UTC)
    return Task(
        task_id=task_id,
        job_id="job",
        run_id="run",
        round=1,
        name="train",
        payload_sha256=None,
        deadline=when,
        slots=1,
        targeted=True,
        state=TaskState.OPEN,
        created_at=when,
    )


def test_the_oldest_task_goes_first_once_full() -> None:
    known = KnownTasks(limit=2)
    a, b, c = _task("a"), _task("b"), _task("c")
    known.add([a, b])
    assert known.get("a") == a and known.get("b") == b and known.get("c") is None
    known.add([c])
    assert known.get("a") is None and known.get("b") == b and known.get("c") == c
    assert "c" in known and "a" not in known


def test_a_full_cache_keeps_the_newest_entries_in_order_through_many_evictions() -> None:
    cache: OrderedDict[str, int] = OrderedDict()
    for i in range(5_000):
        remember(cache, f"k{i}", i, 1_000)
    assert list(cache) == [f"k{i}" for i in range(4_000, 5_000)]
    remember(cache, "k4500", -1, 1_000)  # a known key is updated in place, nothing is dropped
    assert len(cache) == 1_000 and cache["k4500"] == -1 and next(iter(cache)) == "k4000"
