"""Read-side queries the workflows and the device protocol need about a round's tasks."""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from fedlink.server.domain import Assignment
from fedlink.server.store import rows
from fedlink.server.store.core import StoreCore
from fedlink.server.store.schema import assignments, task_targets, tasks

# Keeps IN lists well below SQLite's bound-parameter limit.
_IN_BATCH = 500


class RoundQueries(StoreCore):
    """Assignments and targets of many tasks at once, and blob read permission."""

    async def list_assignments(self, *, task_ids: Sequence[str]) -> Sequence[Assignment]:
        """Return every assignment of these tasks (all states), oldest first."""
        out: list[Assignment] = []
        async with self._db.read() as conn:
            for start in range(0, len(task_ids), _IN_BATCH):
                chunk = list(task_ids[start : start + _IN_BATCH])
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
            for start in range(0, len(task_ids), _IN_BATCH):
                chunk = list(task_ids[start : start + _IN_BATCH])
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
