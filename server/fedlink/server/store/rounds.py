"""What the workflows and the device protocol ask and change about a round: its tasks, its counts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from fedlink.common.errors import NotFound
from fedlink.server.domain import Assignment, AssignmentState, ResultStatus, RunFence, TaskState
from fedlink.server.store import rows
from fedlink.server.store.core import StoreCore
from fedlink.server.store.fencing import check_fence
from fedlink.server.store.protocol import ResultOutline, RoundSummary
from fedlink.server.store.schema import (
    IN_BATCH,
    assignments,
    results,
    round_counts,
    runs,
    task_offers,
    task_targets,
    tasks,
)


def add_to_round_counts(
    conn: sa.Connection, run_id: str, round: int, name: str, *, accepted: int = 0, retries: int = 0
) -> tuple[int, int]:
    """Adds to a round's ``round_counts`` row (made if missing) in one statement; returns its
    (accepted, retries) after. The row stays locked until the transaction ends, so concurrent adders
    take turns and each sees the others' committed counts."""
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    row = {"run_id": run_id, "round": round, "name": name, "accepted": accepted, "retries": retries}
    insert = dialect.insert(round_counts).values(**row)
    upsert = insert.on_conflict_do_update(
        index_elements=[round_counts.c.run_id, round_counts.c.round, round_counts.c.name],
        set_={
            "accepted": round_counts.c.accepted + insert.excluded.accepted,
            "retries": round_counts.c.retries + insert.excluded.retries,
        },
    ).returning(round_counts.c.accepted, round_counts.c.retries)
    after = conn.execute(upsert).one()
    return int(after[0]), int(after[1])


_HELD = [AssignmentState.LEASED.value, AssignmentState.COMPLETED.value]
_LOST = [AssignmentState.EXPIRED.value, AssignmentState.RELEASED.value, AssignmentState.FAILED.value]


class RoundQueries(StoreCore):
    """Assignments and targets of many tasks at once, and blob read permission."""

    async def list_assignments(self, *, task_ids: Sequence[str]) -> Sequence[Assignment]:
        """Return every assignment of these tasks (all states), oldest first."""
        out: list[Assignment] = []
        async with self._db.read() as conn:
            for start in range(0, len(task_ids), IN_BATCH):
                chunk = list(task_ids[start : start + IN_BATCH])
                query = (
                    sa.select(assignments)
                    .where(assignments.c.task_id.in_(chunk))
                    .order_by(assignments.c.created_at, assignments.c.assignment_id)
                )
                out.extend(rows.assignment(r) for r in (await conn.execute(query)).all())
        return out

    async def task_targets(self, *, task_ids: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """Return the devices each targeted task is offered to (untargeted tasks are absent)."""
        out: dict[str, list[str]] = {}
        async with self._db.read() as conn:
            for start in range(0, len(task_ids), IN_BATCH):
                chunk = list(task_ids[start : start + IN_BATCH])
                query = (
                    sa.select(task_targets.c.task_id, task_targets.c.device_id)
                    .where(task_targets.c.task_id.in_(chunk))
                    .order_by(task_targets.c.task_id, task_targets.c.device_id)
                )
                for task_id, device_id in (await conn.execute(query)).all():
                    out.setdefault(task_id, []).append(device_id)
        return {k: tuple(v) for k, v in out.items()}

    async def device_may_read_blob(self, device_id: str, sha256: str) -> bool:
        """True if the blob is the input of a task the device holds (or held) an assignment for."""
        query = (
            sa.select(sa.literal(1))
            .select_from(assignments.join(tasks, tasks.c.task_id == assignments.c.task_id))
            .where(assignments.c.device_id == device_id, tasks.c.payload_sha256 == sha256)
            .limit(1)
        )
        async with self._db.read() as conn:
            return (await conn.execute(query)).first() is not None

    async def round_summary(self, *, run_id: str, round: int, name: str) -> RoundSummary:
        """Counts a round's tasks of one name by what their devices did (one query, no payloads)."""
        # Counted by the database, one row back: fetching a row per task cost the coordinator's event
        # loop ~30 ms per 1,000 tasks (datetime conversion), re-read every 50 ms while a round runs.
        params = {"run_id": run_id, "round": round, "name": name}
        async with self._db.read() as conn:
            found = (await conn.execute(_ROUND_SUMMARY, params)).one()
        return RoundSummary(
            tasks=int(found[0]),
            first_wave=int(found[1]),
            open=int(found[2]),
            succeeded=int(found[3]),
            owing=int(found[4]),
            lost_open=int(found[5]),
            next_deadline=found[6],
            oldest_unclaimed=found[7],
        )

    async def result_outlines(self, run_id: str) -> list[ResultOutline]:
        """Every result of the run, six columns each: whole result and task rows of a 10,000-device
        simulation's three rounds had cost its end 2.4 s."""
        query = (
            sa.select(
                tasks.c.round,
                tasks.c.name,
                results.c.device_id,
                results.c.status,
                results.c.accepted,
                results.c.error_message,
            )
            .join(tasks, tasks.c.task_id == results.c.task_id)
            .where(tasks.c.run_id == run_id)
        )
        async with self._db.read() as conn:
            found = (await conn.execute(query)).all()
        return [
            ResultOutline(
                round=round_no,
                task_name=name,
                device_id=device_id,
                status=ResultStatus(status),
                accepted=bool(accepted),
                error_message=error_message,
            )
            for round_no, name, device_id, status, accepted, error_message in found
        ]

    async def round_retries(self, *, run_id: str, round: int, name: str) -> int:
        """How many retries of a round of one name :meth:`count_round_retry` counted."""
        query = sa.select(round_counts.c.retries).where(
            round_counts.c.run_id == run_id, round_counts.c.round == round, round_counts.c.name == name
        )
        async with self._db.read() as conn:
            found: int | None = (await conn.execute(query)).scalar()
        return found or 0

    async def count_round_retry(
        self, *, run_id: str, round: int, name: str, fence: RunFence | None = None
    ) -> int:
        """Count one more retry of a round of one name; return the retries counted, this one included.

        NotFound if the run does not exist; with a ``fence``, RunLeaseLost unless it holds the run.
        """

        def work(conn: sa.Connection) -> int:
            check_fence(conn, fence)
            if conn.execute(sa.select(runs.c.run_id).where(runs.c.run_id == run_id)).first() is None:
                raise NotFound(f"run {run_id} does not exist")
            return add_to_round_counts(conn, run_id, round, name, retries=1)[1]

        return await self._db.write_sync(work)

    async def close_round_tasks(
        self, *, run_id: str, round: int, name: str, fence: RunFence | None = None
    ) -> int:
        """Close every OPEN task of a round of one name (and withdraw their offers); return how many closed.

        Later reports for them are recorded as stale: the round has moved on. With a ``fence``, only
        while it holds the run (else RunLeaseLost, and nothing closes).
        """
        open_tasks = (
            tasks.c.run_id == run_id,
            tasks.c.round == round,
            tasks.c.name == name,
            tasks.c.state == TaskState.OPEN.value,
        )
        # Offers first, by a subquery, and no RETURNING: a round's ids read back cost a step each
        # (on SQLite a GIL hand-off each, slow while the event loop is busy).
        withdraw = sa.delete(task_offers).where(
            task_offers.c.task_id.in_(sa.select(tasks.c.task_id).where(*open_tasks))
        )
        close = sa.update(tasks).where(*open_tasks).values(state=TaskState.CLOSED.value)

        def work(conn: sa.Connection) -> int:
            check_fence(conn, fence)
            conn.execute(withdraw)
            return int(conn.execute(close).rowcount)

        return await self._db.write_sync(work)

    async def close_tasks(self, task_ids: Sequence[str], *, fence: RunFence | None = None) -> int:
        """Close those of these tasks that are OPEN (and withdraw their offers), in one transaction;
        return how many closed. Later reports for them are recorded as stale. With a ``fence``, only
        while it holds the run (else RunLeaseLost, and nothing closes)."""
        if not task_ids:
            return 0
        ids = sa.bindparam("task_ids", expanding=True, type_=tasks.c.task_id.type)
        withdraw = sa.delete(task_offers).where(task_offers.c.task_id.in_(ids))
        close = (
            sa.update(tasks)
            .where(tasks.c.task_id.in_(ids), tasks.c.state == TaskState.OPEN.value)
            .values(state=TaskState.CLOSED.value)
        )

        def work(conn: sa.Connection) -> int:
            check_fence(conn, fence)
            closed = 0
            for start in range(0, len(task_ids), IN_BATCH):
                chunk = {"task_ids": list(task_ids[start : start + IN_BATCH])}
                conn.execute(withdraw, chunk)
                closed += int(conn.execute(close, chunk).rowcount)
            return closed

        return await self._db.write_sync(work)


def _round_summary_statement() -> sa.Select[int, int, int, int, int, int, Any, Any]:
    """The round summary's query, built once with bind parameters (building it cost more than running
    it: the workflow asks for a summary of a 10,000-task round twice a second)."""
    t = tasks.alias("t")
    answered = sa.exists().where(results.c.task_id == t.c.task_id, results.c.stale.is_(False))
    succeeded = sa.exists().where(
        results.c.task_id == t.c.task_id,
        results.c.status == ResultStatus.SUCCEEDED.value,
        results.c.accepted.is_(True),
    )
    held = sa.exists().where(assignments.c.task_id == t.c.task_id, assignments.c.state.in_(_HELD))
    claimed = sa.exists().where(assignments.c.task_id == t.c.task_id)
    lost = sa.exists().where(assignments.c.task_id == t.c.task_id, assignments.c.state.in_(_LOST))
    run_id = sa.bindparam("run_id", type_=tasks.c.run_id.type)
    round_no = sa.bindparam("round", type_=tasks.c.round.type)
    name = sa.bindparam("name", type_=tasks.c.name.type)
    first = sa.select(sa.func.min(tasks.c.created_at)).where(
        tasks.c.run_id == run_id, tasks.c.round == round_no, tasks.c.name == name
    )
    is_open = t.c.state == TaskState.OPEN.value

    def count(condition: sa.ColumnElement[bool]) -> sa.ColumnElement[int]:
        return sa.func.coalesce(sa.func.sum(sa.case((condition, 1), else_=0)), 0)

    return sa.select(
        sa.func.count(),
        count(t.c.created_at == first.scalar_subquery()),
        count(is_open),
        count(succeeded),
        count(sa.and_(is_open, ~answered, ~sa.and_(lost, ~held))),
        # A failed result counts as lost too: its slot is free for a replacement device.
        count(sa.and_(is_open, lost, ~held, ~succeeded)),
        sa.func.min(sa.case((is_open, t.c.deadline))),
        sa.func.min(sa.case((sa.and_(is_open, ~claimed, ~answered), t.c.created_at))),
    ).where(t.c.run_id == run_id, t.c.round == round_no, t.c.name == name)


_ROUND_SUMMARY = _round_summary_statement()
