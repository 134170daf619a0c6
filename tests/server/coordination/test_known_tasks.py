"""KnownTasks keeps the latest tasks by id, up to its limit."""

from __future__ import annotations

from datetime import UTC, datetime

from fedlink.server.coordination.known_tasks import KnownTasks
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
