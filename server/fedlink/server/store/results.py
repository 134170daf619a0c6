"""Recording what devices report: once per assignment, idempotent on retry, stale when late."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

import sqlalchemy as sa

from fedlink.common.errors import Conflict, FedlinkError, InvalidArgument, NotFound, PermissionDenied
from fedlink.server.domain import AssignmentState, ReportOutcome, Result, ResultStatus, TaskState, new_id
from fedlink.server.store import rows
from fedlink.server.store.blobs import SqlBlobStore
from fedlink.server.store.bulk import insert_new_rows
from fedlink.server.store.core import StoreCore
from fedlink.server.store.event_log import append_job_events
from fedlink.server.store.protocol import RecordOutcome, ResultReport
from fedlink.server.store.rounds import add_to_round_counts
from fedlink.server.store.schema import (
    IN_BATCH,
    among,
    assignments,
    results,
    state_is,
    tasks,
)

_LEASED = AssignmentState.LEASED.value
#: A round's results of one task name: (run id, round, task name).
_RoundKey = tuple[str, int, str]
# A report loses a race only to another report or the lease reaper; each loss settles the assignment.
_MAX_ATTEMPTS = 3


def _same_report(existing: Result, report: ResultReport) -> RecordOutcome:
    """The original outcome for a retried report; Conflict for a different one."""
    if existing.request_id == report.request_id or existing.report_digest == report.report_digest:
        outcome = ReportOutcome.STALE if existing.stale else ReportOutcome.ACCEPTED
        return RecordOutcome(outcome=outcome, result=existing, duplicate=True)
    raise Conflict(
        f"assignment {report.assignment_id} already has a different result (request {existing.request_id})"
    )


def _stale_reason(row: sa.Row[Any], now: datetime) -> str | None:
    if row.state != _LEASED:
        return f"the assignment is {row.state}"
    if row.lease_expires_at <= now:
        return "the lease expired"
    if row.task_state != TaskState.OPEN.value:
        return f"the task is {row.task_state}"
    if row.deadline <= now:
        return "the task's deadline passed"
    return None


class ResultQueries(StoreCore):
    """The results part of the SQL store."""

    #: The blob store on the same database (set by the SqlStateStore): reports' payloads go with them.
    _blob_store: SqlBlobStore

    async def record_results(
        self, reports: Sequence[ResultReport], now: datetime, *, payloads: Sequence[tuple[str, bytes]] = ()
    ) -> list[RecordOutcome | FedlinkError]:
        """Record many reports in one transaction; each item is an outcome or the error it earned.

        A report is checked before anything is written for it, so one bad report changes nothing
        and does not stop the others. ``payloads``: (sha256, bytes) of the reports' inline results,
        stored as blobs (once per content, as ``blobs.put_many`` does) in the same transaction: one
        commit per report batch, not two.
        """
        for report in reports:
            if not report.request_id:
                raise InvalidArgument("a result report needs a request_id")
        if not reports:
            return []
        statements = self._result_statements()
        write_payloads = None
        if payloads:
            _, write_payloads = await self._blob_store.prepare_many(
                [data for _, data in payloads], sha256s=[sha for sha, _ in payloads]
            )

        inline = {sha for sha, _ in payloads}

        def work(conn: sa.Connection) -> list[RecordOutcome | FedlinkError]:
            fresh = write_payloads(conn) if write_payloads is not None else set()
            written: list[_Plan] = []
            outcomes = _record_batch(statements, conn, reports, now, written)
            _result_events(conn, written, now)
            used = {(str(sha), p.report.device_id) for p in written if (sha := p.row["payload_sha256"])}
            # A payload this batch stored that no recorded result points at (a refused, conflicting or
            # late report's) never commits; an uploaded blob a result now points at is used up.
            self._blob_store.drop_new(conn, fresh - {sha for sha, _ in used})
            self._blob_store.mark_used(conn, [(sha, device) for sha, device in used if sha not in inline])
            return outcomes

        return await self._db.write_sync(work)

    async def record_result(self, report: ResultReport, now: datetime) -> RecordOutcome:
        """Record one report (idempotent); raises what :meth:`record_results` would put in its slot."""
        (outcome,) = await self.record_results([report], now)
        if isinstance(outcome, FedlinkError):
            raise outcome
        return outcome

    def _result_statements(self) -> _ResultStatements:
        statements: _ResultStatements | None = getattr(self, "_results_prepared", None)
        if statements is None:
            statements = _ResultStatements(self._db.insert_ignore(results), array=not self._db.is_sqlite)
            self._results_prepared = statements
        return statements

    async def list_results(
        self,
        *,
        task_id: str | None = None,
        task_ids: Sequence[str] | None = None,
        run_id: str | None = None,
        round: int | None = None,
        accepted_only: bool = True,
    ) -> Sequence[Result]:
        """Return results of a task, of these tasks, or of a run's round, ordered by device_id
        (canonical order; for ``task_ids``, within each batch of a few hundred)."""
        query = sa.select(results).order_by(results.c.device_id, results.c.task_id)
        if accepted_only:
            query = query.where(results.c.accepted.is_(True))
        if task_ids is not None:
            found: list[Result] = []
            async with self._db.read() as conn:
                for start in range(0, len(task_ids), IN_BATCH):
                    chunk = list(task_ids[start : start + IN_BATCH])
                    found.extend(
                        rows.result(r) for r in await conn.execute(query.where(results.c.task_id.in_(chunk)))
                    )
            return found
        if task_id is not None:
            query = query.where(results.c.task_id == task_id)
        elif run_id is not None:
            in_run = sa.select(tasks.c.task_id).where(tasks.c.run_id == run_id)
            if round is not None:
                in_run = in_run.where(tasks.c.round == round)
            query = query.where(results.c.task_id.in_(in_run))
        else:
            raise InvalidArgument("list_results needs a task_id, task_ids or a run_id")
        async with self._db.read() as conn:
            return [rows.result(r) for r in await conn.execute(query)]


_ID = sa.bindparam("assignment_id", type_=assignments.c.assignment_id.type)
# Reports per set-based round trip: IN lists stay far below SQLite's bound-parameter limit.
_CHUNK = 256


class _ResultStatements:
    """The report path's statements, built once with bind parameters (compiled once, cached)."""

    def __init__(self, insert: sa.Insert, *, array: bool = False) -> None:
        ids = among(assignments.c.assignment_id, "assignment_ids", array=array)
        # An assignment, its task, and its result if it has one (results.* is NULL otherwise): what a
        # report is judged by, in one statement. The assignment's own columns carry an a_ prefix.
        judged: sa.Select[Any] = sa.select(
            *results.c,
            assignments.c.assignment_id.label("a_assignment_id"),
            assignments.c.device_id.label("a_device_id"),
            assignments.c.task_id.label("a_task_id"),
            assignments.c.state,
            assignments.c.lease_expires_at,
            tasks.c.state.label("task_state"),
            tasks.c.deadline,
            # Where a recorded result is counted, for its result_received event.
            tasks.c.job_id.label("t_job_id"),
            tasks.c.run_id.label("t_run_id"),
            tasks.c.round.label("t_round"),
            tasks.c.name.label("t_name"),
        ).select_from(
            assignments.join(tasks, tasks.c.task_id == assignments.c.task_id).outerjoin(
                results, results.c.assignment_id == assignments.c.assignment_id
            )
        )
        self.judged_one = judged.where(assignments.c.assignment_id == _ID)
        # The batch's assignments are locked as they are judged (PostgreSQL; SQLite's writers are
        # serialised anyway), so the state they are judged in is the state they are moved from.
        self.judged_many = judged.where(ids).with_for_update(of=assignments)
        leased = state_is(assignments.c.state, _LEASED)
        target = sa.bindparam("target", type_=assignments.c.state.type)
        self.move_one = (
            sa.update(assignments).where(assignments.c.assignment_id == _ID, leased).values(state=target)
        )
        # By primary key alone: with "state = 'LEASED'" here PostgreSQL planned a BitmapAnd with the
        # leased partial indexes, walking every dead entry they keep until VACUUM (the rows are locked
        # and were judged LEASED, so the guard is not needed).
        self.move_many = (
            sa.update(assignments).where(ids).values(state=target).returning(assignments.c.assignment_id)
        )
        # The results' INSERT ... ON CONFLICT DO NOTHING: insert_new_rows says which went in by their
        # fresh result ids, and the Result is what was written (reading rows back had cost the report
        # path a row conversion, and on SQLite a GIL hand-off, per result).
        self.insert = insert


@dataclass(frozen=True, slots=True)
class _Plan:
    """What one report will write: its assignment's next state (None: unchanged) and its result row."""

    index: int
    report: ResultReport
    target: AssignmentState | None
    row: dict[str, object]
    #: The task's job, and the (run, round, task name) whose results it counts among.
    job_id: str
    group: _RoundKey


def _plan(index: int, report: ResultReport, row: sa.Row[Any], now: datetime) -> _Plan:
    """Judge a report against its assignment (already checked to be the reporter's, without a result)."""
    stale = _stale_reason(row, now) is not None
    target: AssignmentState | None
    if stale:
        # Late work frees nothing it still holds: a LEASED assignment ends as EXPIRED.
        target = AssignmentState.EXPIRED if row.state == _LEASED else None
    elif report.status is ResultStatus.SUCCEEDED:
        target = AssignmentState.COMPLETED
    else:
        target = AssignmentState.FAILED
    values: dict[str, object] = {
        "result_id": new_id(),
        "assignment_id": report.assignment_id,
        "task_id": row.a_task_id,
        "device_id": report.device_id,
        "status": report.status.value,
        "payload_sha256": None if stale or report.status is ResultStatus.FAILED else report.payload_sha256,
        "report_digest": report.report_digest,
        "error_message": report.error_message,
        "accepted": not stale and report.status is ResultStatus.SUCCEEDED,
        "stale": stale,
        "request_id": report.request_id,
        "created_at": now,
    }
    group = (row.t_run_id, row.t_round, row.t_name)
    return _Plan(index=index, report=report, target=target, row=values, job_id=row.t_job_id, group=group)


def _recorded(plan: _Plan) -> RecordOutcome:
    """The outcome of a report whose result row (``plan.row``) was inserted."""
    values = plan.row
    result = Result(
        result_id=str(values["result_id"]),
        assignment_id=plan.report.assignment_id,
        task_id=str(values["task_id"]),
        device_id=plan.report.device_id,
        status=plan.report.status,
        payload_sha256=cast("str | None", values["payload_sha256"]),
        report_digest=plan.report.report_digest,
        error_message=plan.report.error_message,
        accepted=bool(values["accepted"]),
        stale=bool(values["stale"]),
        request_id=plan.report.request_id,
        created_at=cast(datetime, values["created_at"]),
    )
    outcome = ReportOutcome.STALE if result.stale else ReportOutcome.ACCEPTED
    return RecordOutcome(outcome=outcome, result=result, duplicate=False)


def _record_batch(
    statements: _ResultStatements,
    conn: sa.Connection,
    reports: Sequence[ResultReport],
    now: datetime,
    written: list[_Plan],
) -> list[RecordOutcome | FedlinkError]:
    """Record ``reports`` inside the caller's write transaction with a few set-based statements; the
    plans of the results written are appended to ``written``, in the order they were written.

    One SELECT of the assignments (with their tasks and any results they have), an UPDATE per next
    assignment state, one multi-row INSERT of results. A report that lost a race (or that
    repeats an assignment of the same batch) is judged again alone, after the others are written.
    """
    outcomes: list[RecordOutcome | FedlinkError | None] = [None] * len(reports)
    plans, again = _judge(statements, conn, reports, now, outcomes)
    _write(statements, conn, plans, outcomes, written)
    again.extend(p.index for p in plans.values() if outcomes[p.index] is None)
    for index in sorted(again):
        try:
            outcomes[index] = _record_one(statements, conn, reports[index], now, written)
        except FedlinkError as error:
            outcomes[index] = error
    return [o for o in outcomes if o is not None]


def _judge(
    statements: _ResultStatements,
    conn: sa.Connection,
    reports: Sequence[ResultReport],
    now: datetime,
    outcomes: list[RecordOutcome | FedlinkError | None],
) -> tuple[dict[str, _Plan], list[int]]:
    """Settle what needs no write (errors, retries); plan the rest; list the reports to judge later."""
    found: dict[str, sa.Row[Any]] = {}
    ids = sorted({r.assignment_id for r in reports})
    for start in range(0, len(ids), _CHUNK):
        chunk = {"assignment_ids": ids[start : start + _CHUNK]}
        found.update((r.a_assignment_id, r) for r in conn.execute(statements.judged_many, chunk).all())
    plans: dict[str, _Plan] = {}
    again: list[int] = []
    for index, report in enumerate(reports):
        try:
            row = found.get(report.assignment_id)
            if row is None:
                raise NotFound(f"assignment {report.assignment_id} does not exist")
            if row.a_device_id != report.device_id:
                raise PermissionDenied(f"assignment {report.assignment_id} belongs to another device")
            if row.result_id is not None:
                outcomes[index] = _same_report(rows.result(row), report)
            elif report.assignment_id in plans:
                again.append(index)  # judged against the first one's result once that is written
            else:
                plans[report.assignment_id] = _plan(index, report, row, now)
        except FedlinkError as error:
            outcomes[index] = error
    return plans, again


def _write(
    statements: _ResultStatements,
    conn: sa.Connection,
    plans: dict[str, _Plan],
    outcomes: list[RecordOutcome | FedlinkError | None],
    written: list[_Plan],
) -> None:
    """Move the assignments (one UPDATE per next state), then insert the results of those that moved."""
    by_target: dict[AssignmentState, list[str]] = {}
    for plan in plans.values():
        if plan.target is not None:
            by_target.setdefault(plan.target, []).append(plan.report.assignment_id)
    lost: set[str] = set()
    for target, moving in by_target.items():
        moved: set[str] = set()
        for start in range(0, len(moving), _CHUNK):
            params = {"assignment_ids": moving[start : start + _CHUNK], "target": target.value}
            moved.update(conn.execute(statements.move_many, params).scalars().all())
        # Another report or the lease reaper got there first (the rows are locked as they are judged,
        # so this is a guard only): those are judged again.
        lost.update(a for a in moving if a not in moved)
    writes = [p.row for a, p in plans.items() if a not in lost]
    went_in = insert_new_rows(conn, statements.insert, results.c.result_id, writes)
    for plan in plans.values():  # a lost plan's row was not written: its fresh id cannot be in
        if plan.row["result_id"] in went_in:
            outcomes[plan.index] = _recorded(plan)
            written.append(plan)


def _record_one(
    statements: _ResultStatements,
    conn: sa.Connection,
    report: ResultReport,
    now: datetime,
    written: list[_Plan],
) -> RecordOutcome:
    """Record one report, judging it again after each race it loses."""
    params = {"assignment_id": report.assignment_id}
    for _ in range(_MAX_ATTEMPTS):
        row = conn.execute(statements.judged_one, params).first()
        if row is None:
            raise NotFound(f"assignment {report.assignment_id} does not exist")
        if row.a_device_id != report.device_id:
            raise PermissionDenied(f"assignment {report.assignment_id} belongs to another device")
        if row.result_id is not None:
            return _same_report(rows.result(row), report)
        plan = _plan(0, report, row, now)
        if plan.target is not None:
            moved = conn.execute(statements.move_one, {**params, "target": plan.target.value})
            if moved.rowcount != 1:
                continue  # another report or the reaper got there first: judge again
        if insert_new_rows(conn, statements.insert, results.c.result_id, [plan.row]):
            written.append(plan)
            return _recorded(plan)
    raise Conflict(f"assignment {report.assignment_id} changed while its result was being recorded")


_RESULT_RECEIVED = "result_received"


def _result_events(conn: sa.Connection, written: Sequence[_Plan], now: datetime) -> None:
    """A ``result_received`` job event per result this batch ``written`` that counts (accepted, or
    failed: late ones count for nothing), in the batch's transaction: an event exists exactly when its
    result does. Its ``num_results`` is how many results of the round (and task name) were accepted
    with it; a failed result's reason is its ``error``."""
    counted = [plan for plan in written if not plan.row["stale"]]
    if not counted:
        return
    # The rounds' accepted counts move on by this batch's; each round's row stays locked until commit,
    # so a concurrent batch's results are counted (and their events numbered) wholly before or after.
    adding = Counter(plan.group for plan in counted if plan.row["accepted"])
    running: dict[_RoundKey, int] = {}
    for key in sorted({plan.group for plan in counted}):
        total, _ = add_to_round_counts(conn, *key, accepted=adding[key])
        running[key] = total - adding[key]
    events = []
    for plan in counted:
        running[plan.group] += bool(plan.row["accepted"])
        # What json.dumps(..., sort_keys=True) writes, without its per-call cost (10,000 per round).
        reason = plan.row["error_message"] if plan.report.status is ResultStatus.FAILED else ""
        error = f'"error": {json.dumps(reason)}, ' if reason else ""
        body = (
            f'{{"device_id": {json.dumps(plan.report.device_id)}, {error}"num_results": '
            f'{running[plan.group]}, "round": {plan.group[1]}, "status": "{plan.report.status.value}"}}'
        )
        events.append((plan.job_id, _RESULT_RECEIVED, body))
    append_job_events(conn, events, now)
