"""A fencing counter on runs, so a paused driver's writes are refused once another replica took over.

Revision ID: 0008_run_fencing
Revises: 0007_device_liveness
Create Date: 2026-12-16 09:00:00

- ``runs.lease_epoch``: one more each time a different owner takes a run's lease. A driver's run-state
  writes (checkpoints, round closes, tasks, the run's end) carry the epoch it took the lease at and are
  refused in their own transaction once it moved on. Runs made before the upgrade start at 0; their
  current owner's next renewal keeps it, a takeover makes it 1.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0008_run_fencing"
down_revision: str | None = "0007_device_liveness"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("lease_epoch", sa.BigInteger(), server_default="0", nullable=False))


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("lease_epoch")
