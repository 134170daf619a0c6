"""blob_grants: which devices proved they hold a blob (uploaded it whole), for proof of possession.

Revision ID: 0004_blob_grants
Revises: 0003_task_offers
Create Date: 2026-11-30 09:45:00

Blobs stored before this revision get no grants: a device that reports one of them uploads it again
(its bytes are checked against the sha256 and kept once), which is what a runner does anyway when
GetBlobUploadStatus says nothing was received.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004_blob_grants"
down_revision: str | None = "0003_task_offers"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "blob_grants",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("device_id", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["sha256"], ["blobs.sha256"], name=op.f("fk_blob_grants_sha256_blobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("sha256", "device_id", name=op.f("pk_blob_grants")),
    )


def downgrade() -> None:
    """Revert this revision."""
    op.drop_table("blob_grants")
