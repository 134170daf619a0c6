"""Jobs, their runs, checkpoints and progress events."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.common.errors import FailedPrecondition, InvalidArgument, NotFound
from fedlink.server.domain import (
    Checkpoint,
    Job,
    JobEvent,
    JobState,
    Run,
    RunEnded,
    RunFence,
    RunLeaseHeld,
    RunState,
    is_final,
    new_id,
    transition_job,
    transition_run,
)
from fedlink.server.store import rows
from fedlink.server.store.blobs import SqlBlobStore
from fedlink.server.store.core import StoreCore
from fedlink.server.store.event_log import append_job_events
from fedlink.server.store.fencing import check_fence, check_fence_async
from fedlink.server.store.protocol import NewJob, Page
from fedlink.server.store.schema import blobs, checkpoints, job_events, jobs, results, runs, tasks

#: Job states whose events are kept whole (``job watch`` follows them).
_LIVE_JOB_STATES = tuple(state.value for state in JobState if not is_final(state))

log = logging.getLogger(__name__)


class JobQueries(StoreCore):
    """The jobs, runs, checkpoints and events part of the SQL store."""

    _blob_store: SqlBlobStore

    async def create_job(self, new_job: NewJob) -> Job:
        """Create a PENDING job."""
        if not new_job.name:
            raise InvalidArgument("a job needs a name")
        now = self._clock.now()
        values = {
            "job_id": new_id(),
            "name": new_job.name,
            "state": JobState.PENDING.value,
            "spec_json": new_job.spec_json,
            "job_data": new_job.job_data,
            "initial_model_sha256": new_job.initial_model_sha256,
            "initial_model_size_bytes": new_job.initial_model_size_bytes,
            "device_selector": rows.dump_map(new_job.device_selector),
            "message": "",
            "created_at": now,
            "updated_at": now,
        }

        async def work(conn: AsyncConnection) -> Job:
            if new_job.initial_model_sha256:
                # The model counts as stored now: no collection takes it from the job being created.
                await conn.execute(
                    sa.update(blobs)
                    .where(blobs.c.sha256 == new_job.initial_model_sha256)
                    .values(created_at=now)
                )
            return rows.job((await conn.execute(sa.insert(jobs).values(values).returning(jobs))).one())

        return await self._db.write(work)

    async def get_job(self, job_id: str) -> Job:
        """Return a job; NotFound if unknown."""
        async with self._db.read() as conn:
            row = await self._fetch_one(conn, sa.select(jobs).where(jobs.c.job_id == job_id), f"job {job_id}")
        return rows.job(row)

    async def list_jobs(
        self, *, page_size: int = 100, page_token: str = "", state: JobState | None = None
    ) -> Page[Job]:
        """List jobs, newest first, with a stable keyset page token."""
        size = rows.check_page_size(page_size)
        query = sa.select(jobs).order_by(jobs.c.created_at.desc(), jobs.c.job_id.desc())
        if state is not None:
            query = query.where(jobs.c.state == state.value)
        if page_token:
            when, last_id = rows.decode_page_token(page_token)
            query = query.where(rows.before(jobs.c.created_at, jobs.c.job_id, when, last_id))
        async with self._db.read() as conn:
            found = [rows.job(r) for r in (await conn.execute(query.limit(size + 1))).all()]
        items = found[:size]
        token = rows.encode_page_token(items[-1].created_at, items[-1].job_id) if len(found) > size else ""
        return Page(items=items, next_page_token=token)

    async def set_job_state(
        self,
        job_id: str,
        target: JobState,
        message: str = "",
        *,
        fence: RunFence | None = None,
        event: tuple[str, str] | None = None,
    ) -> Job:
        """Move a job to ``target``; IllegalTransition if its state machine has no such edge.

        With a ``fence``, only while it holds its run (else RunLeaseLost), checked in the same transaction;
        with an ``event`` (kind, payload JSON), that event is appended in the same transaction too.
        """

        async def work(conn: AsyncConnection) -> Job:
            job = await move(conn)
            if event is not None:
                now = job.updated_at
                kind, payload_json = event
                await conn.run_sync(lambda sync: append_job_events(sync, [(job_id, kind, payload_json)], now))
            return job

        async def move(conn: AsyncConnection) -> Job:
            await check_fence_async(conn, fence)
            where = jobs.c.job_id == job_id
            row = await self._fetch_one(conn, sa.select(jobs).where(where), f"job {job_id}")
            transition_job(JobState(row.state), target)
            updated = (
                await conn.execute(
                    sa.update(jobs)
                    .where(where, jobs.c.state == row.state)
                    .values(state=target.value, message=message, updated_at=self._clock.now())
                    .returning(jobs)
                )
            ).first()
            if updated is None:
                # Someone else moved it between our read and our write: judge again against theirs.
                return await move(conn)
            return rows.job(updated)

        return await self._db.write(work)

    async def delete_job(self, job_id: str) -> int:
        """Delete a final job with everything it owns; return the blob bytes freed."""

        async def work(conn: AsyncConnection) -> set[str]:
            row = await self._fetch_one(conn, sa.select(jobs).where(jobs.c.job_id == job_id), f"job {job_id}")
            if not is_final(JobState(row.state)):
                raise FailedPrecondition(f"job {job_id} is {row.state}: abort it before deleting it")
            referenced = await _blobs_of_job(conn, job_id)
            if row.initial_model_sha256:
                referenced.add(row.initial_model_sha256)
            # Foreign keys cascade to runs, tasks, targets, assignments, results, checkpoints, events.
            await conn.execute(sa.delete(jobs).where(jobs.c.job_id == job_id))
            return referenced

        candidates = await self._db.write(work)
        return await self._blob_store.delete_if_unreferenced(candidates)

    # ---- runs ----
    async def acquire_job_run(self, job_id: str, *, owner: str, now: datetime, lease: timedelta) -> Run:
        """The run that drives the job, with ``owner`` holding its lease: created by the first
        coordinator to ask (two asking at once make one run, not two), renewed for its owner, taken
        over once its lease lapsed (the ``lease_epoch`` goes up: the old owner's fenced writes fail),
        RunLeaseHeld while another owner's lease holds, and RunEnded once the run ended."""
        values = {
            "run_id": new_id(),
            "job_id": job_id,
            "state": RunState.RUNNING.value,
            "owner": owner,
            "owner_lease_expires_at": now + lease,
            "round": 0,
            "global_model_sha256": None,
            "metrics_json": "[]",
            "message": "",
            "created_at": now,
            "updated_at": now,
            "lease_epoch": 1,
        }
        current = (
            sa.select(runs.c.run_id)
            .where(runs.c.job_id == job_id)
            .order_by(runs.c.created_at.desc(), runs.c.run_id.desc())
            .limit(1)
        )

        async def work(conn: AsyncConnection) -> Run:
            # Locks in the order fenced writes take them (the run's row, then the job's): no deadlock.
            run_id = (await conn.execute(current.with_for_update(key_share=True))).scalar()
            if run_id is None:
                # No run yet: the job's row serialises the coordinators that would create one, and
                # the look again (after the lock) sees the run of one that got there first.
                job = sa.select(jobs.c.job_id).where(jobs.c.job_id == job_id)
                await self._fetch_one(conn, job.with_for_update(key_share=True), f"job {job_id}")
                run_id = (await conn.execute(current)).scalar()
            if run_id is None:
                return rows.run((await conn.execute(sa.insert(runs).values(values).returning(runs))).one())
            return await self._take_lease(conn, run_id, owner=owner, now=now, lease=lease)

        return await self._db.write(work)

    async def get_run(self, run_id: str) -> Run:
        """Return a run; NotFound if unknown."""
        async with self._db.read() as conn:
            row = await self._fetch_one(conn, sa.select(runs).where(runs.c.run_id == run_id), f"run {run_id}")
        return rows.run(row)

    async def get_current_run(self, job_id: str) -> Run:
        """Return the job's latest run; NotFound if it has none."""
        query = (
            sa.select(runs)
            .where(runs.c.job_id == job_id)
            .order_by(runs.c.created_at.desc(), runs.c.run_id.desc())
            .limit(1)
        )
        async with self._db.read() as conn:
            row = await self._fetch_one(conn, query, f"a run of job {job_id}")
        return rows.run(row)

    async def acquire_run_lease(self, run_id: str, *, owner: str, now: datetime, lease: timedelta) -> Run:
        """Take or renew the lease to drive a run; RunLeaseHeld if another owner's lease holds, RunEnded
        if the run has ended (an ended run is left as it is).

        Taken from another owner (or from nobody), the run's ``lease_epoch`` goes up by one: the writes
        fenced with the previous owner's :attr:`Run.fence` are refused from then on.
        """

        async def work(conn: AsyncConnection) -> Run:
            return await self._take_lease(conn, run_id, owner=owner, now=now, lease=lease)

        return await self._db.write(work)

    async def _take_lease(
        self, conn: AsyncConnection, run_id: str, *, owner: str, now: datetime, lease: timedelta
    ) -> Run:
        free = sa.or_(
            runs.c.owner.is_(None),
            runs.c.owner == owner,
            runs.c.owner_lease_expires_at <= now,
        )
        epoch = sa.case((runs.c.owner == owner, runs.c.lease_epoch), else_=runs.c.lease_epoch + 1)
        running = runs.c.state == RunState.RUNNING.value
        updated = (
            await conn.execute(
                sa.update(runs)
                .where(runs.c.run_id == run_id, running, free)
                .values(owner=owner, owner_lease_expires_at=now + lease, updated_at=now, lease_epoch=epoch)
                .returning(runs)
            )
        ).first()
        if updated is not None:
            return rows.run(updated)
        row = await self._fetch_one(conn, sa.select(runs).where(runs.c.run_id == run_id), f"run {run_id}")
        held = rows.run(row)
        if held.state is not RunState.RUNNING:
            raise RunEnded(run_id, held.state.value)
        raise RunLeaseHeld(run_id, held.owner or "", held.owner_lease_expires_at)

    async def renew_run_lease(self, fence: RunFence, *, now: datetime, lease: timedelta) -> Run:
        """Extend the lease ``fence`` took to ``now + lease``; RunLeaseLost if another owner took the run
        since (even after it lapsed), or it ended. A paused driver's renewer cannot take it back."""

        async def work(conn: AsyncConnection) -> Run:
            await check_fence_async(conn, fence)
            updated = await conn.execute(
                sa.update(runs)
                .where(runs.c.run_id == fence.run_id)
                .values(owner_lease_expires_at=now + lease, updated_at=now)
                .returning(runs)
            )
            return rows.run(updated.one())

        return await self._db.write(work)

    async def finish_run(
        self, run_id: str, target: RunState, message: str = "", *, fence: RunFence | None = None
    ) -> Run:
        """Move a run to a final state; IllegalTransition if it has ended already (with a ``fence``:
        RunLeaseLost if it ended, or another owner took it, since the fence's lease was taken)."""

        async def work(conn: AsyncConnection) -> Run:
            await check_fence_async(conn, fence)
            row = await self._fetch_one(conn, sa.select(runs).where(runs.c.run_id == run_id), f"run {run_id}")
            transition_run(RunState(row.state), target)
            updated = await conn.execute(
                sa.update(runs)
                .where(runs.c.run_id == run_id)
                .values(state=target.value, message=message, owner=None, updated_at=self._clock.now())
                .returning(runs)
            )
            return rows.run(updated.one())

        return await self._db.write(work)

    async def save_checkpoint(
        self,
        run_id: str,
        round: int,
        model_sha256: str,
        metrics_json: str,
        *,
        keep_last: int,
        state_json: str = "{}",
        state_sha256: str | None = None,
        fence: RunFence | None = None,
        events: Sequence[tuple[str, str]] = (),
    ) -> Checkpoint:
        """Record a round's model, metrics and workflow state on the run, in one transaction; keep only
        the last ``keep_last`` checkpoints. With a ``fence``, only while it holds the run (else
        RunLeaseLost, and nothing is recorded). ``events`` (kind, payload JSON) are appended to the run's
        job in the same transaction: a round's event is there exactly when its checkpoint is. With a
        ``fence`` and events, a job that has ended (an operator's abort between the job's state and its
        run's) refuses them with RunLeaseLost: a job's final state event stays its last.

        The run itself points at the newest model and state, so the final model outlives the pruning.
        The blobs of pruned checkpoints and of the run's previous state are freed unless something
        else still points at them (a task's payload, another checkpoint).
        """
        if keep_last < 1:
            raise InvalidArgument(f"keep_last must be >= 1, got {keep_last}")
        now = self._clock.now()
        state = {"workflow_state_json": state_json, "workflow_state_sha256": state_sha256}

        if fence is not None and fence.run_id != run_id:
            raise InvalidArgument(f"a checkpoint of run {run_id} fenced by run {fence.run_id}'s lease")

        def work(conn: sa.Connection) -> tuple[Checkpoint, set[str]]:
            check_fence(conn, fence)
            where = runs.c.run_id == run_id
            previous = conn.execute(
                sa.select(runs.c.workflow_state_sha256, runs.c.job_id).where(where)
            ).first()
            if previous is None:
                raise NotFound(f"run {run_id} does not exist")
            conn.execute(
                sa.delete(checkpoints).where(checkpoints.c.run_id == run_id, checkpoints.c.round == round)
            )
            saved = conn.execute(
                sa.insert(checkpoints)
                .values(
                    run_id=run_id,
                    round=round,
                    model_sha256=model_sha256,
                    metrics_json=metrics_json,
                    created_at=now,
                    **state,
                )
                .returning(checkpoints)
            )
            conn.execute(
                sa.update(runs)
                .where(where)
                .values(
                    round=round,
                    global_model_sha256=model_sha256,
                    metrics_json=metrics_json,
                    updated_at=now,
                    **state,
                )
            )
            newest = (
                conn.execute(
                    sa.select(checkpoints.c.round)
                    .where(checkpoints.c.run_id == run_id)
                    .order_by(checkpoints.c.round.desc())
                    .limit(keep_last)
                )
                .scalars()
                .all()
            )
            pruned = conn.execute(
                sa.delete(checkpoints)
                .where(checkpoints.c.run_id == run_id, checkpoints.c.round.not_in(list(newest)))
                .returning(checkpoints.c.model_sha256, checkpoints.c.workflow_state_sha256)
            ).all()
            freed = {sha for row in pruned for sha in row if sha}
            if previous.workflow_state_sha256:
                freed.add(previous.workflow_state_sha256)
            if events:  # last: the job's events lock is held from here to the commit
                mine = [(previous.job_id, kind, body) for kind, body in events]
                append_job_events(conn, mine, now, fence=fence)
            return rows.checkpoint(saved.one()), freed - {model_sha256, state_sha256 or ""}

        checkpoint, candidates = await self._db.write_sync(work)
        if candidates:
            try:
                await self._blob_store.delete_if_unreferenced(candidates)
            except Exception as exc:  # the checkpoint is in: storage collection frees them later
                log.warning("could not free the blobs a checkpoint left unused: %s", exc)
        return checkpoint

    async def list_checkpoints(self, run_id: str) -> Sequence[Checkpoint]:
        """Return a run's kept checkpoints, oldest round first."""
        query = sa.select(checkpoints).where(checkpoints.c.run_id == run_id).order_by(checkpoints.c.round)
        async with self._db.read() as conn:
            return [rows.checkpoint(r) for r in (await conn.execute(query)).all()]

    # ---- events ----
    async def append_job_event(
        self, job_id: str, kind: str, payload_json: str, *, fence: RunFence | None = None
    ) -> JobEvent:
        """Append a progress event to a job (numbered as :mod:`~fedlink.server.store.event_log` says);
        with a ``fence``, only while it holds its run (else RunLeaseLost)."""
        now = self._clock.now()

        def work(conn: sa.Connection) -> JobEvent:
            check_fence(conn, fence)
            if conn.execute(sa.select(jobs.c.job_id).where(jobs.c.job_id == job_id)).first() is None:
                raise NotFound(f"job {job_id} does not exist")
            (sequence,) = append_job_events(conn, [(job_id, kind, payload_json)], now, fence=fence)
            return JobEvent(job_id=job_id, sequence=sequence, time=now, kind=kind, payload_json=payload_json)

        return await self._db.write_sync(work)

    async def list_job_events(
        self, job_id: str, *, after_sequence: int = 0, limit: int = 1000
    ) -> Sequence[JobEvent]:
        """Return a job's events after ``after_sequence``, in order."""
        query = (
            sa.select(job_events)
            .where(job_events.c.job_id == job_id, job_events.c.sequence > after_sequence)
            .order_by(job_events.c.sequence)
            .limit(limit)
        )
        async with self._db.read() as conn:
            found = [rows.job_event(r) for r in (await conn.execute(query)).all()]
            if not found:
                await self._fetch_one(
                    conn, sa.select(jobs.c.job_id).where(jobs.c.job_id == job_id), f"job {job_id}"
                )
        return found

    async def prune_job_events(self, *, finished_before: datetime, keep_per_job: int) -> int:
        """Trim the events of finished jobs; return how many were deleted.

        A job finished (its ``updated_at``) before ``finished_before`` keeps only its last event (how it
        ended); any other finished job its newest ``keep_per_job``. A pending or running job keeps all
        of them: ``job watch`` replays them. The last event always stays, so the job's numbering goes on
        from where it was.
        """
        if keep_per_job < 1:
            raise InvalidArgument(f"keep_per_job must be >= 1, got {keep_per_job}")
        finished = sa.select(jobs.c.job_id, jobs.c.updated_at).where(jobs.c.state.not_in(_LIVE_JOB_STATES))
        async with self._db.read() as conn:
            ended = (await conn.execute(finished)).all()
            bounds: list[tuple[str, int]] = []
            for job_id, updated_at in ended:
                of_job = job_events.c.job_id == job_id
                # Two index probes of (job_id, sequence), not a scan of the job's events.
                first = sa.select(sa.func.min(job_events.c.sequence)).where(of_job).scalar_subquery()
                last = sa.select(sa.func.max(job_events.c.sequence)).where(of_job).scalar_subquery()
                low, high = (await conn.execute(sa.select(first, last))).one()
                if high is None:
                    continue
                keep_from = high if updated_at < finished_before else high - keep_per_job + 1
                if low < keep_from:
                    bounds.append((job_id, keep_from))
        deleted = 0
        for job_id, keep_from in bounds:

            async def work(conn: AsyncConnection, job_id: str = job_id, keep_from: int = keep_from) -> int:
                statement = sa.delete(job_events).where(
                    job_events.c.job_id == job_id, job_events.c.sequence < keep_from
                )
                return int((await conn.execute(statement)).rowcount)

            deleted += await self._db.write(work)
        return deleted

    async def live_jobs_using_blob(self, sha256: str) -> list[str]:
        """The pending or running jobs whose initial model, run, task, result or checkpoint is the blob."""
        live = jobs.c.state.in_(_LIVE_JOB_STATES)
        queries = [
            sa.select(jobs.c.job_id).where(live, jobs.c.initial_model_sha256 == sha256),
            sa.select(runs.c.job_id)
            .join(jobs, jobs.c.job_id == runs.c.job_id)
            .where(
                live, sa.or_(runs.c.global_model_sha256 == sha256, runs.c.workflow_state_sha256 == sha256)
            ),
            sa.select(tasks.c.job_id)
            .join(jobs, jobs.c.job_id == tasks.c.job_id)
            .where(live, tasks.c.payload_sha256 == sha256),
            sa.select(tasks.c.job_id)
            .join(results, results.c.task_id == tasks.c.task_id)
            .join(jobs, jobs.c.job_id == tasks.c.job_id)
            .where(live, results.c.payload_sha256 == sha256),
            sa.select(runs.c.job_id)
            .join(checkpoints, checkpoints.c.run_id == runs.c.run_id)
            .join(jobs, jobs.c.job_id == runs.c.job_id)
            .where(
                live,
                sa.or_(checkpoints.c.model_sha256 == sha256, checkpoints.c.workflow_state_sha256 == sha256),
            ),
        ]
        found: set[str] = set()
        async with self._db.read() as conn:
            for query in queries:
                found.update((await conn.execute(query)).scalars())
        return sorted(found)


async def _blobs_of_job(conn: AsyncConnection, job_id: str) -> set[str]:
    """Every blob a job's runs, tasks, results and checkpoints (models and workflow states) point at."""
    queries = [
        sa.select(runs.c.global_model_sha256).where(runs.c.job_id == job_id),
        sa.select(runs.c.workflow_state_sha256).where(runs.c.job_id == job_id),
        sa.select(tasks.c.payload_sha256).where(tasks.c.job_id == job_id),
        sa.select(results.c.payload_sha256)
        .join(tasks, tasks.c.task_id == results.c.task_id)
        .where(tasks.c.job_id == job_id),
        sa.select(checkpoints.c.model_sha256)
        .join(runs, runs.c.run_id == checkpoints.c.run_id)
        .where(runs.c.job_id == job_id),
        sa.select(checkpoints.c.workflow_state_sha256)
        .join(runs, runs.c.run_id == checkpoints.c.run_id)
        .where(runs.c.job_id == job_id),
    ]
    found: set[str] = set()
    for query in queries:
        found.update(sha for sha in (await conn.execute(query)).scalars() if sha)
    return found
