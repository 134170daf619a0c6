"""Claim lookups that do not scan a job's open tasks: targets by device, untargeted open tasks.

Revision ID: 0002_claim_lookups
Revises: 0001_initial
Create Date: 2026-11-30 07:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002_claim_lookups"
down_revision: str | None = "0001_initial"
branch_labels: str | None = None
depends_on: str | None = None

_UNTARGETED_SQLITE = sa.text("state = 'OPEN' AND targeted = 0")
_UNTARGETED_PG = sa.text("state = 'OPEN' AND targeted = false")


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("task_targets", schema=None) as batch_op:
        batch_op.create_index("ix_task_targets_device_task", ["device_id", "task_id"], unique=False)
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.create_index(
            "ix_tasks_open_untargeted_job_created",
            ["job_id", "created_at"],
            unique=False,
            sqlite_where=_UNTARGETED_SQLITE,
            postgresql_where=_UNTARGETED_PG,
        )


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_tasks_open_untargeted_job_created",
            sqlite_where=_UNTARGETED_SQLITE,
            postgresql_where=_UNTARGETED_PG,
        )
    with op.batch_alter_table("task_targets", schema=None) as batch_op:
        batch_op.drop_index("ix_task_targets_device_task")
