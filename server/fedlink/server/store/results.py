"""Recording what devices report: once per assignment, idempotent on retry, stale when late."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.common.errors import Conflict, FedlinkError, InvalidArgument, PermissionDenied
from fedlink.server.domain import AssignmentState, ReportOutcome, Result, ResultStatus, TaskState, new_id
from fedlink.server.store import rows
from fedlink.server.store.core import StoreCore
from fedlink.server.store.protocol import RecordOutcome, ResultReport
from fedlink.server.store.schema import assignments, results, state_is, tasks

_LEASED = AssignmentState.LEASED.value
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

    async def record_results(
        self, reports: Sequence[ResultReport], now: datetime
    ) -> list[RecordOutcome | FedlinkError]:
        """Record many reports in one transaction; each item is an outcome or the error it earned.

        A report is checked before anything is written for it, so one bad report changes nothing
        and does not stop the others.
        """
        for report in reports:
            if not report.request_id:
                raise InvalidArgument("a result report needs a request_id")

        async def work(conn: AsyncConnection) -> list[RecordOutcome | FedlinkError]:
            outcomes: list[RecordOutcome | FedlinkError] = []
            for report in reports:
                try:
                    outcomes.append(await self._record_one(conn, report, now))
                except FedlinkError as error:
                    outcomes.append(error)
            return outcomes

        return await self._db.write(work)

    async def record_result(self, report: ResultReport, now: datetime) -> RecordOutcome:
        """Record one report (idempotent); raises what :meth:`record_results` would put in its slot."""
        (outcome,) = await self.record_results([report], now)
        if isinstance(outcome, FedlinkError):
            raise outcome
        return outcome

    async def _existing(self, conn: AsyncConnection, assignment_id: str) -> Result | None:
        row = (await conn.execute(sa.select(results).where(results.c.assignment_id == assignment_id))).first()
        return None if row is None else rows.result(row)

    async def _record_one(self, conn: AsyncConnection, report: ResultReport, now: datetime) -> RecordOutcome:
        query = (
            sa.select(assignments, tasks.c.state.label("task_state"), tasks.c.deadline)
            .join(tasks, tasks.c.task_id == assignments.c.task_id)
            .where(assignments.c.assignment_id == report.assignment_id)
        )
        for _ in range(_MAX_ATTEMPTS):
            row = await self._fetch_one(conn, query, f"assignment {report.assignment_id}")
            if row.device_id != report.device_id:
                raise PermissionDenied(f"assignment {report.assignment_id} belongs to another device")
            if (existing := await self._existing(conn, report.assignment_id)) is not None:
                return _same_report(existing, report)
            stale = _stale_reason(row, now) is not None
            if stale:
                # Late work frees nothing it still holds: a LEASED assignment ends as EXPIRED.
                target = AssignmentState.EXPIRED if row.state == _LEASED else None
            elif report.status is ResultStatus.SUCCEEDED:
                target = AssignmentState.COMPLETED
            else:
                target = AssignmentState.FAILED
            if target is not None:
                moved = await conn.execute(
                    sa.update(assignments)
                    .where(
                        assignments.c.assignment_id == report.assignment_id,
                        state_is(assignments.c.state, _LEASED),
                    )
                    .values(state=target.value)
                )
                if moved.rowcount != 1:
                    continue  # another report or the reaper got there first: judge again
            inserted = (
                await conn.execute(
                    self._db.insert_ignore(results)
                    .values(
                        result_id=new_id(),
                        assignment_id=report.assignment_id,
                        task_id=row.task_id,
                        device_id=report.device_id,
                        status=report.status.value,
                        payload_sha256=None
                        if stale or report.status is ResultStatus.FAILED
                        else report.payload_sha256,
                        report_digest=report.report_digest,
                        error_message=report.error_message,
                        accepted=not stale and report.status is ResultStatus.SUCCEEDED,
                        stale=stale,
                        request_id=report.request_id,
                        created_at=now,
                    )
                    .returning(results)
                )
            ).first()
            if inserted is None:
                continue
            result = rows.result(inserted)
            outcome = ReportOutcome.STALE if stale else ReportOutcome.ACCEPTED
            return RecordOutcome(outcome=outcome, result=result, duplicate=False)
        raise Conflict(f"assignment {report.assignment_id} changed while its result was being recorded")

    async def list_results(
        self,
        *,
        task_id: str | None = None,
        run_id: str | None = None,
        round: int | None = None,
        accepted_only: bool = True,
    ) -> Sequence[Result]:
        """Return results of a task, or of a run's round, ordered by device_id (canonical order)."""
        query = sa.select(results).order_by(results.c.device_id, results.c.task_id)
        if task_id is not None:
            query = query.where(results.c.task_id == task_id)
        elif run_id is not None:
            in_run = sa.select(tasks.c.task_id).where(tasks.c.run_id == run_id)
            if round is not None:
                in_run = in_run.where(tasks.c.round == round)
            query = query.where(results.c.task_id.in_(in_run))
        else:
            raise InvalidArgument("list_results needs a task_id or a run_id")
        if accepted_only:
            query = query.where(results.c.accepted.is_(True))
        async with self._db.read() as conn:
            return [rows.result(r) for r in await conn.execute(query)]
