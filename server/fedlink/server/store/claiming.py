"""The claim hot path: a batch of task requests served with a few set-based statements.

For a batch, one SELECT finds every re-delivery (a device asking again for the lease it holds), one
SELECT finds each remaining device's oldest claimable task offered to it (FedAvg's case), and one
multi-row ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` takes them. On PostgreSQL the two SELECTs
walk the batch's (device, job) pairs with ``unnest`` and a LATERAL ``ORDER BY ... LIMIT 1`` subquery:
per pair an index scan that stops at the first hit, whatever the planner's statistics say (the
server may run without autovacuum, and an IN list of 64 devices under default selectivities looked
like a third of the table: it chose sequential and bitmap scans that grew with the history and with
the dead index entries that only plain index scans mark and skip). Requests that lost a race for a
slot, or that need an untargeted task, go through the per-request path. The unique indexes on
assignments are what makes double assignment impossible; these statements only make the common case
cheap. Synchronous SQLAlchemy code: it runs whole in the store's writer thread on a SQLite file
(:meth:`~fedlink.server.store.dialect.Database.write_sync`).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from fedlink.server.domain import (
    ACTIVE_ASSIGNMENT_STATES,
    Assignment,
    AssignmentState,
    new_id,
)
from fedlink.server.store import rows
from fedlink.server.store.bulk import insert_new_rows
from fedlink.server.store.protocol import ClaimRequest
from fedlink.server.store.schema import assignments, state_is, task_offers, tasks

_LEASED = AssignmentState.LEASED.value
# Literal predicates matching the partial indexes in schema.py (same states, same order).
_ACTIVE_SQL = state_is(assignments.c.state, "LEASED", "COMPLETED")
_LEASED_SQL = state_is(assignments.c.state, "LEASED")
_OPEN_SQL = state_is(tasks.c.state, "OPEN")
assert {AssignmentState.LEASED, AssignmentState.COMPLETED} == ACTIVE_ASSIGNMENT_STATES
# How many looks a claim may take when it keeps losing races; each lost race means another device
# got a task, so the system as a whole makes progress.
_MAX_LOOKS = 50
# Requests per set-based round trip: IN lists stay far below SQLite's bound-parameter limit.
_CHUNK = 256

_DEVICE = sa.bindparam("device_id", type_=assignments.c.device_id.type)
_JOB = sa.bindparam("job_id", type_=assignments.c.job_id.type)
_NOW = sa.bindparam("now", type_=tasks.c.deadline.type)
_DEVICES = sa.bindparam("device_ids", expanding=True, type_=assignments.c.device_id.type)
_JOBS = sa.bindparam("job_ids", expanding=True, type_=assignments.c.job_id.type)
_COLUMNS = [
    "assignment_id",
    "task_id",
    "job_id",
    "device_id",
    "slot",
    "state",
    "lease_expires_at",
    "created_at",
]

Pair = tuple[str, str]  # (device_id, job_id)


def _has_assignment(
    task_id: sa.ColumnElement[str], device_id: sa.ColumnElement[str]
) -> sa.ColumnElement[bool]:
    """The device already has an assignment (in any state) of the task: one per (task, device)."""
    return sa.exists().where(assignments.c.task_id == task_id, assignments.c.device_id == device_id)


def _has_free_slot(task_id: sa.ColumnElement[str], slots: sa.ColumnElement[int]) -> sa.ColumnElement[bool]:
    active = sa.select(sa.func.count()).where(assignments.c.task_id == task_id, _ACTIVE_SQL).scalar_subquery()
    return active < slots


def _lowest_free_slot(task_id: sa.ColumnElement[str]) -> sa.ColumnElement[int]:
    """The task's lowest slot no active assignment holds (0, or one past a held slot with a gap after it).

    Below the task's slots whenever fewer than that are held, which the candidate filters ensure.
    One scalar subquery over the task's own active assignments (a left join finds the gaps): an
    EXISTS test here was turned by PostgreSQL into a hashed subplan over the active assignments of
    every task, a walk of the whole history per claim batch.
    """
    held, after = assignments.alias("held"), assignments.alias("after")
    gap_after = sa.case((after.c.slot.is_(None), held.c.slot + 1))
    return (
        sa.select(sa.case((sa.func.min(held.c.slot) == 0, sa.func.min(gap_after)), else_=0))
        .select_from(
            held.outerjoin(
                after,
                sa.and_(
                    after.c.task_id == held.c.task_id,
                    after.c.slot == held.c.slot + 1,
                    state_is(after.c.state, "LEASED", "COMPLETED"),
                ),
            )
        )
        .where(held.c.task_id == task_id, state_is(held.c.state, "LEASED", "COMPLETED"))
        .scalar_subquery()
    )


def _pairs() -> Any:
    """The batch's (device, job) pairs as a table: ``unnest`` of two arrays of the same length."""
    array = postgresql.ARRAY(assignments.c.device_id.type)
    return (
        sa.func.unnest(sa.bindparam("device_ids", type_=array), sa.bindparam("job_ids", type_=array))
        .table_valued("device_id", "job_id")
        .render_derived(name="wanted", with_types=False)
    )


def _offered() -> sa.Join:
    return task_offers.join(tasks, tasks.c.task_id == task_offers.c.task_id)


def _claimable(device_id: sa.ColumnElement[str]) -> tuple[sa.ColumnElement[bool], ...]:
    """An offered task the device may claim: still OPEN, before its deadline, not yet taken by the
    device, a slot free. The subqueries are on task_offers' columns, so SQLite runs them only for
    the device's own offers."""
    return (
        _OPEN_SQL,
        tasks.c.deadline > _NOW,
        ~_has_assignment(task_offers.c.task_id, device_id),
        _has_free_slot(task_offers.c.task_id, tasks.c.slots),
    )


class ClaimStatements:
    """The claim path's statements, built once with bind parameters.

    Building SQLAlchemy constructs (aliases, subqueries) per claim cost more Python time than the
    database spent running them; built once, they compile once and hit the compiled cache.
    """

    def __init__(self, insert: sa.Insert, *, lateral: bool = False) -> None:
        self.lateral = lateral
        live_lease = (
            _LEASED_SQL,
            assignments.c.lease_expires_at > _NOW,
            _OPEN_SQL,
            tasks.c.deadline > _NOW,
        )
        held_join = assignments.join(tasks, tasks.c.task_id == assignments.c.task_id)
        self.held = (
            sa.select(assignments)
            .select_from(held_join)
            .where(assignments.c.device_id == _DEVICE, assignments.c.job_id == _JOB, *live_lease)
            .order_by(assignments.c.created_at)
            .limit(1)
        )
        if lateral:
            wanted = _pairs()
            oldest = (
                sa.select(assignments)
                .select_from(held_join)
                .where(
                    assignments.c.device_id == wanted.c.device_id,
                    assignments.c.job_id == wanted.c.job_id,
                    *live_lease,
                )
                .order_by(assignments.c.created_at, assignments.c.assignment_id)
                .limit(1)
                .lateral("oldest")
            )
            self.held_many = sa.select(oldest).select_from(wanted.join(oldest, sa.true()))
        else:
            self.held_many = (
                sa.select(assignments)
                .select_from(held_join)
                .where(assignments.c.device_id.in_(_DEVICES), assignments.c.job_id.in_(_JOBS), *live_lease)
                .order_by(assignments.c.created_at, assignments.c.assignment_id)
            )
        # Two lookups, each served by its own index: the tasks offered to this device (FedAvg's),
        # then the job's untargeted tasks. One OR-ed query would walk every open task of the job.
        targeted = (
            sa.select(tasks.c.task_id)
            .select_from(_offered())
            .where(
                task_offers.c.device_id == _DEVICE,
                task_offers.c.job_id == _JOB,
                *_claimable(_DEVICE),
            )
            .order_by(task_offers.c.created_at, task_offers.c.task_id)
            .limit(1)
        )
        untargeted = (
            sa.select(tasks.c.task_id)
            .where(
                tasks.c.job_id == _JOB,
                # Spelled like ix_tasks_open_untargeted_job_created's predicate, so the planner uses it.
                _OPEN_SQL,
                tasks.c.targeted == sa.false(),
                tasks.c.deadline > _NOW,
                ~_has_assignment(tasks.c.task_id, _DEVICE),
                _has_free_slot(tasks.c.task_id, tasks.c.slots),
            )
            .order_by(tasks.c.created_at, tasks.c.task_id)
            .limit(1)
        )
        self.lookups = [(candidates, self._pick(insert, candidates)) for candidates in (targeted, untargeted)]
        self.untargeted = self.lookups[1]
        self.any_untargeted = sa.select(
            sa.exists().where(
                tasks.c.job_id == _JOB, _OPEN_SQL, tasks.c.targeted == sa.false(), tasks.c.deadline > _NOW
            )
        )
        self.anything = sa.select(sa.or_(self.held.exists(), targeted.exists(), untargeted.exists()))
        self.targeted_many = self._targeted_many_lateral() if lateral else self._targeted_many()
        self.insert = insert

    def batch_params(self, pairs: Sequence[Pair], now: datetime) -> dict[str, Any]:
        """The bind parameters of held_many and targeted_many for these (device, job) pairs."""
        if self.lateral:
            return {"device_ids": [d for d, _ in pairs], "job_ids": [j for _, j in pairs], "now": now}
        return {
            "device_ids": sorted({d for d, _ in pairs}),
            "job_ids": sorted({j for _, j in pairs}),
            "now": now,
        }

    @staticmethod
    def _targeted_many_lateral() -> sa.Select[Any]:
        """targeted_many as one LATERAL index walk per (device, job) pair (PostgreSQL)."""
        wanted = _pairs()
        oldest = (
            sa.select(tasks.c.task_id)
            .select_from(_offered())
            .where(
                task_offers.c.device_id == wanted.c.device_id,
                task_offers.c.job_id == wanted.c.job_id,
                *_claimable(task_offers.c.device_id),
            )
            .order_by(task_offers.c.created_at, task_offers.c.task_id)
            .limit(1)
            .lateral("oldest")
        )
        return sa.select(
            wanted.c.device_id, oldest.c.task_id, wanted.c.job_id, _lowest_free_slot(oldest.c.task_id)
        ).select_from(wanted.join(oldest, sa.true()))

    @staticmethod
    def _targeted_many() -> sa.Select[Any]:
        """Each (device, job)'s oldest claimable task offered to the device, with its lowest free slot."""
        ranked = (
            sa.select(
                task_offers.c.device_id,
                tasks.c.task_id,
                tasks.c.job_id,
                sa.func.row_number()
                .over(
                    partition_by=(task_offers.c.device_id, task_offers.c.job_id),
                    order_by=(task_offers.c.created_at, task_offers.c.task_id),
                )
                .label("rank"),
            )
            .select_from(_offered())
            .where(
                task_offers.c.device_id.in_(_DEVICES),
                task_offers.c.job_id.in_(_JOBS),
                *_claimable(task_offers.c.device_id),
            )
            .subquery("ranked")
        )
        return sa.select(
            ranked.c.device_id, ranked.c.task_id, ranked.c.job_id, _lowest_free_slot(ranked.c.task_id)
        ).where(ranked.c.rank == 1)

    @staticmethod
    def _pick(insert: sa.Insert, candidates: sa.Select[Any]) -> Any:
        pick = candidates.with_only_columns(
            sa.bindparam("assignment_id", type_=assignments.c.assignment_id.type),
            tasks.c.task_id,
            _JOB,
            _DEVICE,
            _lowest_free_slot(tasks.c.task_id),
            sa.literal(_LEASED, assignments.c.state.type),
            sa.bindparam("lease_expires_at", type_=assignments.c.lease_expires_at.type),
            _NOW,
        )
        return insert.from_select(_COLUMNS, pick).returning(assignments)


def claim_batch(
    statements: ClaimStatements,
    conn: sa.Connection,
    requests: Sequence[ClaimRequest],
    now: datetime,
    lease: timedelta,
) -> list[Assignment | None]:
    """Serve ``requests`` inside the caller's write transaction; None where a device gets nothing.

    A device asking twice in one batch gets the same assignment twice, as it would asking twice in
    a row (the second ask is a re-delivery).
    """
    served: dict[Pair, Assignment | None] = {}
    pairs = list(dict.fromkeys((r.device_id, r.job_id) for r in requests))
    for start in range(0, len(pairs), _CHUNK):
        served.update(_claim_chunk(statements, conn, pairs[start : start + _CHUNK], now, lease))
    return [served[(r.device_id, r.job_id)] for r in requests]


def _claim_chunk(
    statements: ClaimStatements, conn: sa.Connection, pairs: list[Pair], now: datetime, lease: timedelta
) -> dict[Pair, Assignment | None]:
    if len(pairs) == 1:
        # Alone, the per-request way takes one statement fewer (the lookup is the INSERT ... SELECT).
        ((device_id, job_id),) = pairs
        params = {"device_id": device_id, "job_id": job_id, "now": now}
        held = conn.execute(statements.held, params).first()
        if held is not None:
            return {pairs[0]: rows.assignment(held)}
        return {pairs[0]: claim_one(statements, conn, device_id, job_id, now, lease)}
    wanted = set(pairs)
    ids = statements.batch_params(pairs, now)
    served: dict[Pair, Assignment | None] = {}
    for row in conn.execute(statements.held_many, ids).all():
        pair = (row.device_id, row.job_id)
        if pair in wanted and pair not in served:  # the oldest lease, as a single re-delivery check
            served[pair] = rows.assignment(row)
    if len(served) == len(pairs):
        return served

    expires = now + lease
    picks: dict[str, Pair] = {}
    new_rows: list[dict[str, Any]] = []
    for device_id, task_id, job_id, slot in conn.execute(statements.targeted_many, ids).all():
        pair = (device_id, job_id)
        if pair in wanted and pair not in served:
            assignment_id = new_id()
            picks[assignment_id] = pair
            new_rows.append(
                {
                    "assignment_id": assignment_id,
                    "task_id": task_id,
                    "job_id": job_id,
                    "device_id": device_id,
                    "slot": slot,
                    "state": _LEASED,
                    "lease_expires_at": expires,
                    "created_at": now,
                }
            )
    # Built from what was written: reading the rows back (RETURNING) costs a step per row.
    went_in = insert_new_rows(conn, statements.insert, assignments.c.assignment_id, new_rows)
    for made in new_rows:
        if made["assignment_id"] in went_in:
            served[picks[made["assignment_id"]]] = _leased(made)

    picked = set(picks.values())
    untargeted_jobs: dict[str, bool] = {}
    for pair in pairs:
        if pair in served:
            continue
        device_id, job_id = pair
        if pair in picked:
            # Its targeted task went to a concurrent claim: another device took the slot first, or
            # (with several coordinators) the same device did, and then this is a re-delivery.
            params = {"device_id": device_id, "job_id": job_id, "now": now}
            held = conn.execute(statements.held, params).first()
            served[pair] = (
                rows.assignment(held)
                if held is not None
                else claim_one(statements, conn, device_id, job_id, now, lease)
            )
            continue
        if job_id not in untargeted_jobs:
            untargeted_jobs[job_id] = bool(
                conn.execute(statements.any_untargeted, {"job_id": job_id, "now": now}).scalar()
            )
        served[pair] = (
            claim_one(statements, conn, device_id, job_id, now, lease, targeted=False)
            if untargeted_jobs[job_id]
            else None
        )
    return served


def _leased(row: dict[str, Any]) -> Assignment:
    """The Assignment an ``assignments`` row just inserted as LEASED stands for."""
    return Assignment(
        assignment_id=row["assignment_id"],
        task_id=row["task_id"],
        job_id=row["job_id"],
        device_id=row["device_id"],
        slot=row["slot"],
        state=AssignmentState.LEASED,
        lease_expires_at=row["lease_expires_at"],
        created_at=row["created_at"],
    )


def claim_one(
    statements: ClaimStatements,
    conn: sa.Connection,
    device_id: str,
    job_id: str,
    now: datetime,
    lease: timedelta,
    *,
    targeted: bool = True,
) -> Assignment | None:
    """Claim for one device: INSERT ... SELECT per lookup, looking again after each lost race."""
    params: dict[str, Any] = {"device_id": device_id, "job_id": job_id, "now": now}
    insert_params = {**params, "lease_expires_at": now + lease}
    for candidates, pick in statements.lookups if targeted else [statements.untargeted]:
        for _ in range(_MAX_LOOKS):
            insert_params["assignment_id"] = new_id()
            inserted = conn.execute(pick, insert_params).first()
            if inserted is not None:
                return rows.assignment(inserted)
            # Nothing inserted: either nothing is left, or a concurrent claim took the slot first.
            if conn.execute(candidates, params).first() is None:
                break
            # A concurrent request of the same device may have won meanwhile: it gets that one again.
            if (row := conn.execute(statements.held, params).first()) is not None:
                return rows.assignment(row)
    return None
