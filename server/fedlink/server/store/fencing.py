"""Fencing a run's writes by its lease: the check a driver's write makes in its own transaction.

Which coordinator drives a run is a lease (``runs.owner`` until ``runs.owner_lease_expires_at``). A
driver paused past its lease (SIGSTOP, a long GC pause, a partition) does not know it lost it, so the
lease alone cannot stop its writes. Each take-over by a different owner bumps ``runs.lease_epoch``; the
driver carries the epoch it took the lease at (a :class:`~fedlink.server.domain.RunFence`) and each of its
run-state writes checks it in the same transaction as the write: once the owner or the epoch moved on,
or the run ended, the write raises RunLeaseLost and changes nothing.

The check locks the run's row until the write commits (PostgreSQL ``FOR NO KEY UPDATE``; a SQLite write
holds the database from ``BEGIN IMMEDIATE``), so a take-over waits for a fenced write in flight and sees
it, and a write after the take-over sees the new epoch. The lock does not conflict with the foreign-key
checks of devices' reports and claims (``FOR KEY SHARE``). A lease that lapsed without anybody taking
it keeps its owner's writes valid: nobody else wrote in between.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.server.domain import JobState, RunFence, RunLeaseLost, RunState, is_final
from fedlink.server.store.schema import jobs, runs

_FENCE = (
    sa.select(runs.c.owner, runs.c.lease_epoch, runs.c.state)
    .where(runs.c.run_id == sa.bindparam("run_id", type_=runs.c.run_id.type))
    .with_for_update(key_share=True)
)


def check_fence(conn: sa.Connection, fence: RunFence | None) -> None:
    """Raise RunLeaseLost unless ``fence`` (if given) still holds its run; lock the run's row."""
    if fence is not None:
        row = conn.execute(_FENCE, {"run_id": fence.run_id}).first()
        _judge(fence, None if row is None else tuple(row))


async def check_fence_async(conn: AsyncConnection, fence: RunFence | None) -> None:
    """:func:`check_fence` on an async connection."""
    if fence is not None:
        row = (await conn.execute(_FENCE, {"run_id": fence.run_id})).first()
        _judge(fence, None if row is None else tuple(row))


def check_jobs_live(conn: sa.Connection, fence: RunFence | None, job_ids: Iterable[str]) -> None:
    """Raise RunLeaseLost if ``fence`` (if given) drives a job that has ended: a job's final state event is
    its last, and an operator ends the job (with that event) before its run. Called once the job's
    events lock is held (:mod:`~fedlink.server.store.event_log`), which that final write takes too."""
    if fence is None:
        return
    for job_id in sorted(set(job_ids)):
        state = conn.execute(sa.select(jobs.c.state).where(jobs.c.job_id == job_id)).scalar()
        if state is not None and is_final(JobState(state)):
            raise RunLeaseLost(fence.run_id, fence.owner, fence.epoch, f"job {job_id} has ended ({state})")


def _judge(fence: RunFence, row: tuple[Any, ...] | None) -> None:
    """Raise RunLeaseLost unless the run's (owner, lease_epoch, state) ``row`` is the fence's."""
    if row is None:
        reason = "the run no longer exists"
    else:
        owner, epoch, state = row
        if state != RunState.RUNNING.value:
            reason = f"the run has ended ({state})"
        elif owner != fence.owner or epoch != fence.epoch:
            reason = f"coordinator {owner!r} took it over (lease epoch {epoch})"
        else:
            return
    raise RunLeaseLost(fence.run_id, fence.owner, fence.epoch, reason)
