"""Tasks, and the hot path: devices claiming them under leases.

A claim INSERTs an assignment row and never updates a shared queue row (PostgreSQL's dead row
versions would pile up on it). Two indexes make double assignment impossible whatever the isolation
level: unique (task_id, device_id), and unique (task_id, slot) over the LEASED/COMPLETED assignments.
A claim picks the lowest slot it sees free and inserts with ON CONFLICT DO NOTHING; if a concurrent
claim took that slot (or task) first, it looks again. A targeted task's devices are also written to
task_offers while it is OPEN; whatever ends a task here withdraws its offers, so a device's claim
looks only at tasks it may still take.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.common.errors import InvalidArgument, PermissionDenied
from fedlink.server.domain import (
    Assignment,
    AssignmentState,
    LeaseLost,
    RunFence,
    Task,
    TaskState,
    new_id,
    transition_task,
)
from fedlink.server.store import rows
from fedlink.server.store.bulk import insert_rows
from fedlink.server.store.claiming import ClaimStatements, claim_batch
from fedlink.server.store.core import StoreCore
from fedlink.server.store.fencing import check_fence, check_fence_async
from fedlink.server.store.protocol import ClaimRequest, NewTask
from fedlink.server.store.schema import (
    IN_BATCH,
    among,
    assignments,
    state_is,
    task_offers,
    task_targets,
    tasks,
)

_LEASED = AssignmentState.LEASED.value
_OPEN = TaskState.OPEN.value
# Literal predicates matching the partial indexes in schema.py (same states, same order).
_LEASED_SQL = state_is(assignments.c.state, "LEASED")
_OPEN_SQL = state_is(tasks.c.state, "OPEN")


def drop_offers(conn: sa.Connection, task_ids: Sequence[str]) -> None:
    """Withdraw the offers of tasks that are no longer OPEN (their targets stay in task_targets)."""
    statement = sa.delete(task_offers).where(
        among(task_offers.c.task_id, "task_ids", array=conn.dialect.name == "postgresql")
    )
    for start in range(0, len(task_ids), IN_BATCH):
        conn.execute(statement, {"task_ids": list(task_ids[start : start + IN_BATCH])})


#: (device, job) pairs per round trip of :meth:`ClaimQueries.has_claimable_many`.
_CLAIMABLE_CHUNK = 500
# The jobs with an open untargeted task: their devices are checked one by one (rare: FedAvg targets).
_UNTARGETED_JOBS = (
    sa.select(tasks.c.job_id)
    .where(
        tasks.c.job_id.in_(sa.bindparam("untargeted_job_ids", expanding=True, type_=tasks.c.job_id.type)),
        _OPEN_SQL,
        tasks.c.targeted == sa.false(),
        tasks.c.deadline > sa.bindparam("now", type_=tasks.c.deadline.type),
    )
    .distinct()
)


class ClaimQueries(StoreCore):
    """The tasks, claims and leases part of the SQL store."""

    async def create_tasks(
        self, new_tasks: Sequence[NewTask], *, fence: RunFence | None = None
    ) -> Sequence[Task]:
        """Create OPEN tasks (and their target lists) in one transaction; with a ``fence``, only while it
        holds its run (else RunLeaseLost, and none is created)."""
        now = self._clock.now()
        task_rows: list[dict[str, object]] = []
        target_rows: list[dict[str, str]] = []
        offer_rows: list[dict[str, object]] = []
        made: list[Task] = []
        for new in new_tasks:
            if new.slots < 1:
                raise InvalidArgument(f"a task needs at least one slot, got {new.slots}")
            if new.deadline.tzinfo is None:
                raise InvalidArgument("task deadlines must be timezone-aware")
            task_id = new_id()
            deadline = new.deadline.astimezone(UTC)
            made.append(
                Task(
                    task_id=task_id,
                    job_id=new.job_id,
                    run_id=new.run_id,
                    round=new.round,
                    name=new.name,
                    payload_sha256=new.payload_sha256,
                    deadline=deadline,
                    slots=new.slots,
                    targeted=bool(new.targets),
                    state=TaskState.OPEN,
                    created_at=now,
                    model_version=new.model_version,
                )
            )
            task_rows.append(
                {
                    "task_id": task_id,
                    "job_id": new.job_id,
                    "run_id": new.run_id,
                    "round": new.round,
                    "name": new.name,
                    "payload_sha256": new.payload_sha256,
                    "deadline": deadline,
                    "slots": new.slots,
                    "targeted": bool(new.targets),
                    "state": _OPEN,
                    "created_at": now,
                    "model_version": new.model_version,
                }
            )
            for device_id in sorted(set(new.targets)):
                target_rows.append({"task_id": task_id, "device_id": device_id})
                offer_rows.append(
                    {"task_id": task_id, "device_id": device_id, "job_id": new.job_id, "created_at": now}
                )
        if not task_rows:
            return []

        # One thread hop on a SQLite file (write_sync): a round's tasks are created while its devices
        # wait, and each statement's hops had cost the round boundary ~0.1-0.3 s at 1,000 devices.
        # The tasks are what was inserted: not read back (a round's 1,000 rows cost ~30 ms to read).
        def work(conn: sa.Connection) -> None:
            check_fence(conn, fence)
            insert_rows(conn, tasks, task_rows)
            insert_rows(conn, task_targets, target_rows)
            insert_rows(conn, task_offers, offer_rows)

        await self._db.write_sync(work)
        return made

    async def get_task(self, task_id: str) -> Task:
        """Return a task; NotFound if unknown."""
        async with self._db.read() as conn:
            row = await self._fetch_one(
                conn, sa.select(tasks).where(tasks.c.task_id == task_id), f"task {task_id}"
            )
        return rows.task(row)

    async def list_tasks(self, run_id: str, *, round: int | None = None) -> Sequence[Task]:
        """Return a run's tasks (of one round if given), oldest first."""
        query = sa.select(tasks).where(tasks.c.run_id == run_id).order_by(tasks.c.created_at, tasks.c.task_id)
        if round is not None:
            query = query.where(tasks.c.round == round)
        async with self._db.read() as conn:
            return [rows.task(r) for r in await conn.execute(query)]

    async def close_task(self, task_id: str, *, fence: RunFence | None = None) -> Task:
        """Close an OPEN task: nobody may claim it any more, and later reports for it are stale. With a
        ``fence``, only while it holds the run (else RunLeaseLost)."""
        return await self._end_task(task_id, TaskState.CLOSED, fence)

    async def cancel_task(self, task_id: str, *, fence: RunFence | None = None) -> Task:
        """Cancel an OPEN task (with a ``fence``, only while it holds the run)."""
        return await self._end_task(task_id, TaskState.CANCELLED, fence)

    async def _end_task(self, task_id: str, target: TaskState, fence: RunFence | None) -> Task:
        async def work(conn: AsyncConnection) -> Task:
            await check_fence_async(conn, fence)
            where = tasks.c.task_id == task_id
            row = await self._fetch_one(conn, sa.select(tasks).where(where), f"task {task_id}")
            transition_task(TaskState(row.state), target)
            updated = await conn.execute(
                sa.update(tasks).where(where).values(state=target.value).returning(tasks)
            )
            await conn.run_sync(drop_offers, [task_id])
            return rows.task(updated.one())

        return await self._db.write(work)

    async def cancel_job_tasks(self, job_id: str, *, fence: RunFence | None = None) -> int:
        """Cancel every OPEN task of a job; return how many. With a ``fence``, only while it holds its
        run (else RunLeaseLost)."""

        async def work(conn: AsyncConnection) -> int:
            await check_fence_async(conn, fence)
            statement = (
                sa.update(tasks)
                .where(tasks.c.job_id == job_id, _OPEN_SQL)
                .values(state=TaskState.CANCELLED.value)
                .returning(tasks.c.task_id)
            )
            cancelled = list((await conn.execute(statement)).scalars())
            await conn.run_sync(drop_offers, cancelled)
            return len(cancelled)

        return await self._db.write(work)

    # ---- claims ----
    async def claim_tasks(
        self, requests: Sequence[ClaimRequest], now: datetime, lease: timedelta
    ) -> list[Assignment | None]:
        """Serve many task requests in one transaction; None where the device has nothing to do.

        Per request: the device's unexpired LEASED assignment in the job if it has one (re-delivery);
        else a new assignment of the oldest OPEN, unexpired task of the job that the device may take
        (untargeted or targeted at it), has no assignment of yet, and that has a free slot.
        """
        if not requests:
            return []

        statements = self._claim_statements()
        return await self._db.write_sync(lambda conn: claim_batch(statements, conn, requests, now, lease))

    async def has_claimable(self, device_id: str, job_id: str, now: datetime) -> bool:
        """Tell, in a read transaction, whether a claim by the device could get anything now.

        Long-polling devices ask far more often than there is work; this check keeps those asks off
        the write path.
        """
        params = {"device_id": device_id, "job_id": job_id, "now": now}
        async with self._db.read() as conn:
            return bool((await conn.execute(self._claim_statements().anything, params)).scalar())

    async def has_claimable_many(self, pairs: Sequence[tuple[str, str]], now: datetime) -> list[bool]:
        """:meth:`has_claimable` for many ``(device_id, job_id)`` pairs in one read transaction.

        A round's devices ask together (each one right after its report); one set-based lookup per
        chunk answers them all, the same answer as asking one by one.
        """
        wanted = list(dict.fromkeys(pairs))
        if not wanted:
            return []
        statements = self._claim_statements()
        found: set[tuple[str, str]] = set()
        async with self._db.read() as conn:
            for start in range(0, len(wanted), _CLAIMABLE_CHUNK):
                chunk = wanted[start : start + _CLAIMABLE_CHUNK]
                # The claim path's own batch lookups: re-deliveries, then offers targeted at the device.
                params = statements.batch_params(chunk, now)
                for row in await conn.execute(statements.held_many, params):
                    found.add((row.device_id, row.job_id))
                for device_id, _, job_id, _ in await conn.execute(statements.targeted_many, params):
                    found.add((device_id, job_id))  # a true fact, if of a pair not asked (IN lists)
                jobs = {"untargeted_job_ids": sorted({j for _, j in chunk}), "now": now}
                untargeted = {r.job_id for r in await conn.execute(_UNTARGETED_JOBS, jobs)}
                for device_id, job_id in chunk:
                    if job_id in untargeted and (device_id, job_id) not in found:
                        one = {"device_id": device_id, "job_id": job_id, "now": now}
                        if (await conn.execute(statements.anything, one)).scalar():
                            found.add((device_id, job_id))
        return [pair in found for pair in pairs]

    def _claim_statements(self) -> ClaimStatements:
        statements: ClaimStatements | None = getattr(self, "_claims_prepared", None)
        if statements is None:
            statements = ClaimStatements(self._db.insert_ignore(assignments), lateral=not self._db.is_sqlite)
            self._claims_prepared = statements
        return statements

    async def claim_task(
        self, device_id: str, job_id: str, now: datetime, lease: timedelta
    ) -> Assignment | None:
        """Serve one task request; None if nothing is available for the device."""
        (claimed,) = await self.claim_tasks([ClaimRequest(device_id=device_id, job_id=job_id)], now, lease)
        return claimed

    async def get_assignment(self, assignment_id: str) -> Assignment:
        """Return an assignment; NotFound if unknown."""
        query = sa.select(assignments).where(assignments.c.assignment_id == assignment_id)
        async with self._db.read() as conn:
            return rows.assignment(await self._fetch_one(conn, query, f"assignment {assignment_id}"))

    async def open_assignments(self, assignment_ids: Sequence[str], now: datetime) -> set[str]:
        """Those of the assignments a report would be counted for at ``now`` (unknown ids are left out):
        LEASED under a lease not yet ended, of an OPEN task whose deadline has not passed."""
        query = (
            sa.select(assignments.c.assignment_id)
            .join(tasks, tasks.c.task_id == assignments.c.task_id)
            .where(
                among(assignments.c.assignment_id, "assignment_ids", array=not self._db.is_sqlite),
                _LEASED_SQL,
                assignments.c.lease_expires_at > now,
                _OPEN_SQL,
                tasks.c.deadline > now,
            )
        )
        found: set[str] = set()
        ids = sorted(set(assignment_ids))
        async with self._db.read() as conn:
            for start in range(0, len(ids), IN_BATCH):
                chunk = {"assignment_ids": ids[start : start + IN_BATCH]}
                found.update((await conn.execute(query, chunk)).scalars())
        return found

    async def _held(self, conn: AsyncConnection, assignment_id: str, device_id: str, now: datetime) -> None:
        """Check ``device_id`` holds a live lease on the assignment; raise what it lacks."""
        query = (
            sa.select(assignments, tasks.c.state.label("task_state"))
            .join(tasks, tasks.c.task_id == assignments.c.task_id)
            .where(assignments.c.assignment_id == assignment_id)
        )
        row = await self._fetch_one(conn, query, f"assignment {assignment_id}")
        if row.device_id != device_id:
            raise PermissionDenied(f"assignment {assignment_id} belongs to another device")
        if row.state != _LEASED:
            raise LeaseLost(assignment_id, f"it is {row.state}")
        if row.lease_expires_at <= now:
            raise LeaseLost(assignment_id, "its lease expired")
        if row.task_state != _OPEN:
            raise LeaseLost(assignment_id, f"its task is {row.task_state}")

    async def renew_lease(
        self, assignment_id: str, device_id: str, now: datetime, lease: timedelta
    ) -> Assignment:
        """Extend a held lease to ``now + lease``; LeaseLost if it is no longer held."""
        return await self._update_held(assignment_id, device_id, now, lease_expires_at=now + lease)

    async def release_assignment(self, assignment_id: str, device_id: str, now: datetime) -> Assignment:
        """Give a held assignment back, freeing its slot; LeaseLost if it is no longer held."""
        return await self._update_held(assignment_id, device_id, now, state=AssignmentState.RELEASED.value)

    async def _update_held(
        self, assignment_id: str, device_id: str, now: datetime, **values: object
    ) -> Assignment:
        async def work(conn: AsyncConnection) -> Assignment:
            await self._held(conn, assignment_id, device_id, now)
            updated = (
                await conn.execute(
                    sa.update(assignments)
                    .where(assignments.c.assignment_id == assignment_id, _LEASED_SQL)
                    .values(**values)
                    .returning(assignments)
                )
            ).first()
            if updated is None:
                raise LeaseLost(assignment_id, "it changed concurrently")
            return rows.assignment(updated)

        return await self._db.write(work)

    async def expire_leases(self, now: datetime) -> Sequence[Assignment]:
        """Expire every LEASED assignment whose lease ended at or before ``now``; return them."""

        async def work(conn: AsyncConnection) -> Sequence[Assignment]:
            expired = await conn.execute(
                sa.update(assignments)
                .where(_LEASED_SQL, assignments.c.lease_expires_at <= now)
                .values(state=AssignmentState.EXPIRED.value)
                .returning(assignments)
            )
            return [rows.assignment(r) for r in expired]

        return await self._db.write(work)
