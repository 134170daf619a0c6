"""round_counts: per round and task name, the results accepted (for the result_received job events)
and the retries the workflow took (so a restarted coordinator does not grant more).

Revision ID: 0005_round_counts
Revises: 0004_blob_grants
Create Date: 2026-11-30 20:30:00

Accepted counts are filled from the results already stored, so a round open during the upgrade counts
on from there; retries taken before the upgrade were not recorded and start at 0.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005_round_counts"
down_revision: str | None = "0004_blob_grants"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "round_counts",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("round", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("accepted", sa.Integer(), server_default="0", nullable=False),
        sa.Column("retries", sa.Integer(), server_default="0", nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_round_counts_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "round", "name", name=op.f("pk_round_counts")),
    )
    op.execute(
        "INSERT INTO round_counts (run_id, round, name, accepted) "
        "SELECT tasks.run_id, tasks.round, tasks.name, count(*) FROM results "
        "JOIN tasks ON tasks.task_id = results.task_id WHERE results.accepted "
        "GROUP BY tasks.run_id, tasks.round, tasks.name"
    )


def downgrade() -> None:
    """Revert this revision."""
    op.drop_table("round_counts")
