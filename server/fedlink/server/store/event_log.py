"""Appending job events inside the caller's write transaction.

A job's events are numbered max + 1 upwards under the ``(job_id, sequence)`` primary key, so they rise in
commit order: a watcher reading "after N" never misses an event that committed late with a smaller
number. Appenders of one job take turns: on SQLite the database has one writer at a time anyway; on
PostgreSQL a transaction-scoped advisory lock per job, taken in job order, serialises them until commit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from datetime import datetime

import sqlalchemy as sa

from fedlink.server.domain import RunFence
from fedlink.server.store.bulk import insert_rows
from fedlink.server.store.fencing import check_jobs_live
from fedlink.server.store.schema import job_events


def _lock_key(job_id: str) -> int:
    """A stable signed 64-bit key for the job's advisory lock."""
    digest = hashlib.sha256(b"fedlink job events\0" + job_id.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def _lock_job_events(conn: sa.Connection, job_ids: Iterable[str]) -> None:
    """Waits for the turn to append events of these jobs, held until the transaction ends (PostgreSQL
    only: SQLite's single writer has it already)."""
    if conn.dialect.name == "postgresql":
        for job_id in sorted(set(job_ids)):  # one order for every appender: none waits on another's
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(_lock_key(job_id))))


def append_job_events(
    conn: sa.Connection,
    events: Sequence[tuple[str, str, str]],
    now: datetime,
    *,
    fence: RunFence | None = None,
) -> list[int]:
    """Appends ``(job_id, kind, payload_json)`` events, in order per job; returns their sequences.

    With a driver's ``fence``, RunLeaseLost if a job has ended: its final state event stays its last.
    The jobs must exist (the foreign key says so on commit otherwise).
    """
    by_job: dict[str, list[int]] = {}
    for index, (job_id, _, _) in enumerate(events):
        by_job.setdefault(job_id, []).append(index)
    sequences = [0] * len(events)
    rows: list[dict[str, object]] = []
    _lock_job_events(conn, by_job)
    check_jobs_live(conn, fence, by_job)
    for job_id in sorted(by_job):
        last = conn.execute(
            sa.select(sa.func.coalesce(sa.func.max(job_events.c.sequence), 0)).where(
                job_events.c.job_id == job_id
            )
        ).scalar_one()
        for sequence, index in enumerate(by_job[job_id], start=last + 1):
            _, kind, payload_json = events[index]
            sequences[index] = sequence
            rows.append(
                {
                    "job_id": job_id,
                    "sequence": sequence,
                    "time": now,
                    "kind": kind,
                    "payload_json": payload_json,
                }
            )
    insert_rows(conn, job_events, rows)
    return sequences
