"""insert_rows writes what SQLAlchemy's executemany writes, in a few multi-row statements on SQLite."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import sqlite

from fedlink.server.domain import ManualClock, TaskState
from fedlink.server.store import SqlStateStore
from fedlink.server.store.bulk import insert_new_rows, insert_rows
from fedlink.server.store.protocol import NewTask
from fedlink.server.store.schema import assignments, tasks
from fedlink.server.store.testing import World


def _task_rows(count: int) -> list[dict[str, Any]]:
    base = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    plus_two = timezone(timedelta(hours=2))
    return [
        {
            "task_id": f"task-{i:05d}",
            "job_id": "job",
            "run_id": "run",
            "round": i % 7,
            "name": "train" if i % 2 else "evaluate",
            "payload_sha256": None if i % 3 else f"{i:064x}",
            # Alternating and repeated values, some in another zone: each must be stored as its UTC text.
            "deadline": (base + timedelta(seconds=i % 5)).astimezone(plus_two if i % 4 else UTC),
            "slots": 1 + i % 3,
            "targeted": bool(i % 2),
            "state": "OPEN",
            "created_at": base,
            "model_version": None if i % 5 else i // 5,
        }
        for i in range(count)
    ]


def _sqlite(path: Path) -> sa.Engine:
    engine = sa.create_engine(f"sqlite:///{path}")
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA foreign_keys = OFF")
    tasks.create(engine)
    return engine


def test_sqlite_rows_are_those_executemany_writes_in_few_statements(tmp_path: Path) -> None:
    rows = _task_rows(1201)
    ours, theirs = _sqlite(tmp_path / "ours.db"), _sqlite(tmp_path / "theirs.db")
    # (statement, parameters, executemany) of each cursor call: before_cursor_execute's arguments.
    calls: list[tuple[str, Any, bool]] = []
    sa.event.listen(ours, "before_cursor_execute", lambda *args: calls.append((args[2], args[3], args[5])))
    with ours.begin() as conn:
        insert_rows(conn, tasks, rows)
    with theirs.begin() as conn:
        conn.execute(sa.insert(tasks), rows)
    raw = "SELECT * FROM tasks ORDER BY task_id"
    with ours.connect() as a, theirs.connect() as b:
        written = a.exec_driver_sql(raw).all()
        assert written == b.exec_driver_sql(raw).all()
        assert len(written) == 1201
        # As the store reads them: the same values that went in.
        read = a.execute(sa.select(tasks).order_by(tasks.c.task_id)).mappings().all()
    assert [dict(r) for r in read] == rows
    # Each statement is one step carrying many rows, not an executemany of one step per row.
    inserts = [(params, many) for sql, params, many in calls if sql.startswith("INSERT")]
    per_statement = min(500, ours.dialect.insertmanyvalues_max_parameters // len(rows[0]))
    assert len(inserts) == math.ceil(1201 / per_statement) <= 3
    assert not any(many for _, many in inserts)
    assert sum(len(params) for params, _ in inserts) == 1201 * len(rows[0])


def _holder(assignment_id: str, device: str, slot: int) -> dict[str, Any]:
    now = datetime(2026, 11, 30, tzinfo=UTC)
    return {
        "assignment_id": assignment_id,
        "task_id": "task",
        "job_id": "job",
        "device_id": device,
        "slot": slot,
        "state": "LEASED",
        "lease_expires_at": now + timedelta(minutes=1),
        "created_at": now,
    }


def test_rows_refused_by_a_uniqueness_rule_are_left_out_and_not_reported_in(tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'slots.db'}")
    assignments.create(engine)
    insert_ignore = sqlite.insert(assignments).on_conflict_do_nothing()
    key = assignments.c.assignment_id
    with engine.begin() as conn:
        assert insert_new_rows(conn, insert_ignore, key, [_holder("a1", "d1", 0)]) == {"a1"}
        # a2 wants the slot a1 holds, a4 repeats a3's device: only a3 goes in.
        rows = [_holder("a2", "d2", 0), _holder("a3", "d3", 1), _holder("a4", "d3", 2)]
        assert insert_new_rows(conn, insert_ignore, key, rows) == {"a3"}
        assert insert_new_rows(conn, insert_ignore, key, []) == set()
    with engine.connect() as conn:
        held = conn.execute(sa.select(key, assignments.c.slot).order_by(key)).all()
    assert [tuple(r) for r in held] == [("a1", 0), ("a3", 1)]


def test_nothing_to_insert_writes_nothing(tmp_path: Path) -> None:
    engine = _sqlite(tmp_path / "empty.db")
    with engine.begin() as conn:
        insert_rows(conn, tasks, [])
        assert conn.exec_driver_sql("SELECT count(*) FROM tasks").scalar() == 0


def test_a_failing_row_fails_the_whole_insert(tmp_path: Path) -> None:
    engine = _sqlite(tmp_path / "dup.db")
    rows = _task_rows(3)
    rows[2] = {**rows[2], "task_id": rows[0]["task_id"]}
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        insert_rows(conn, tasks, rows)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM tasks").scalar() == 0


async def test_a_large_round_of_targeted_tasks_reads_back_as_created(
    store: SqlStateStore, world: World, clock: ManualClock
) -> None:
    devices = [f"device-{i:04d}" for i in range(1100)]  # more than one statement's worth of rows
    deadline = clock.now() + timedelta(minutes=5)
    made = await store.create_tasks(
        [
            NewTask(
                job_id=world.job.job_id,
                run_id=world.run.run_id,
                round=3,
                name="train",
                payload_sha256=None,
                deadline=deadline,
                slots=1,
                targets=(device,),
            )
            for device in devices
        ]
    )
    listed = await store.list_tasks(world.run.run_id, round=3)
    assert sorted(listed, key=lambda t: t.task_id) == sorted(made, key=lambda t: t.task_id)
    assert all(t.state is TaskState.OPEN and t.deadline == deadline and t.targeted for t in listed)
    targets = await store.task_targets(task_ids=[t.task_id for t in made])
    assert sorted(d for ds in targets.values() for d in ds) == devices
