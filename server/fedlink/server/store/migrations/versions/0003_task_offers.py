"""task_offers: the targets of OPEN tasks, so a device's claim does not walk its closed tasks.

Revision ID: 0003_task_offers
Revises: 0002_claim_lookups
Create Date: 2026-11-30 09:15:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003_task_offers"
down_revision: str | None = "0002_claim_lookups"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision: the table, its index, and the offers of the tasks open now."""
    op.create_table(
        "task_offers",
        sa.Column("task_id", sa.String(length=32), nullable=False),
        sa.Column("device_id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.task_id"], name=op.f("fk_task_offers_task_id_tasks"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("task_id", "device_id", name=op.f("pk_task_offers")),
    )
    with op.batch_alter_table("task_offers", schema=None) as batch_op:
        batch_op.create_index(
            "ix_task_offers_device_job_created",
            ["device_id", "job_id", "created_at", "task_id"],
            unique=False,
        )
    op.execute(
        "INSERT INTO task_offers (task_id, device_id, job_id, created_at)"
        " SELECT g.task_id, g.device_id, t.job_id, t.created_at"
        " FROM task_targets g JOIN tasks t ON t.task_id = g.task_id WHERE t.state = 'OPEN'"
    )


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("task_offers", schema=None) as batch_op:
        batch_op.drop_index("ix_task_offers_device_job_created")
    op.drop_table("task_offers")
