"""What devices asked for, and the digest of their enrolment.

Revision ID: 0007_device_liveness
Revises: 0006_workflow_state
Create Date: 2026-12-09 09:00:00

- ``devices.polled_job_name``: the job name a device last asked for with GetJob ("" for any job),
  NULL until it asks. Sampling picks only devices that asked for the job's name (or any job). Devices
  enrolled before the upgrade start as "any job", as they were sampled before; their next GetJob
  records what they ask for. (NULL would leave a running job's devices, which ask for tasks and not
  for jobs, out of its next rounds.)
- ``devices.enrolment_digest``: an HMAC of the Enroll request that created the device, so that a retry
  with the same request_id is answered only if it is the same request. NULL for devices enrolled
  before the upgrade: their enrolments are never answered again.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007_device_liveness"
down_revision: str | None = "0006_workflow_state"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    with op.batch_alter_table("devices") as batch:
        batch.add_column(sa.Column("polled_job_name", sa.String(length=200), nullable=True))
        batch.add_column(sa.Column("enrolment_digest", sa.String(length=64), nullable=True))
    op.execute("UPDATE devices SET polled_job_name = ''")


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("devices") as batch:
        batch.drop_column("enrolment_digest")
        batch.drop_column("polled_job_name")
