"""Workflow state in checkpoints, the version of the model each task carries, initial model sizes.

Revision ID: 0006_workflow_state
Revises: 0005_round_counts
Create Date: 2026-12-02 09:00:00

- ``runs`` and ``checkpoints``: a workflow's own state beside the model (``workflow_state_json``, and
  ``workflow_state_sha256`` for its arrays, such as a server optimizer's moments, kept as a blob).
- ``tasks.model_version``: the version of the model a task carries, for GetTaskResponse.model_version
  (NULL for tasks made before the upgrade: they say none).
- ``jobs.initial_model_size_bytes``: filled from the blobs already stored.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0006_workflow_state"
down_revision: str | None = "0005_round_counts"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    for table in ("runs", "checkpoints"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("workflow_state_json", sa.Text(), server_default="{}", nullable=False))
            batch.add_column(sa.Column("workflow_state_sha256", sa.String(length=64), nullable=True))
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("model_version", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("initial_model_size_bytes", sa.BigInteger(), nullable=True))
    op.execute(
        "UPDATE jobs SET initial_model_size_bytes = "
        "(SELECT blobs.size_bytes FROM blobs WHERE blobs.sha256 = jobs.initial_model_sha256) "
        "WHERE initial_model_sha256 IS NOT NULL"
    )


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("initial_model_size_bytes")
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("model_version")
    for table in ("checkpoints", "runs"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("workflow_state_sha256")
            batch.drop_column("workflow_state_json")
