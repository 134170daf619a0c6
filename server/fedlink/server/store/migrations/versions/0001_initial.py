"""Initial schema: devices, jobs, runs, tasks, assignments, results, blobs, events, keys.

Revision ID: 0001_initial
Revises: (none)
Create Date: 2026-11-30 06:31:57.613112
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001_initial"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    """Apply this revision."""
    op.create_table(
        "blob_chunks",
        sa.Column("blob_key", sa.String(length=80), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("blob_key", "offset", name=op.f("pk_blob_chunks")),
    )
    op.create_table(
        "blob_uploads",
        sa.Column("upload_key", sa.String(length=80), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("received_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("upload_key", name=op.f("pk_blob_uploads")),
    )
    op.create_table(
        "blobs",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_blobs")),
    )
    op.create_table(
        "devices",
        sa.Column("device_id", sa.String(length=32), nullable=False),
        sa.Column("credential_hash", sa.String(length=64), nullable=False),
        sa.Column("device_info", sa.Text(), nullable=False),
        sa.Column("user_info", sa.Text(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("enrolled_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("device_id", name=op.f("pk_devices")),
        sa.UniqueConstraint("credential_hash", name=op.f("uq_devices_credential_hash")),
    )
    with op.batch_alter_table("devices", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_devices_enrolled_at_device_id"), ["enrolled_at", "device_id"], unique=False
        )
        batch_op.create_index(batch_op.f("ix_devices_last_seen"), ["last_seen"], unique=False)

    op.create_table(
        "idempotency_records",
        sa.Column("scope", sa.String(length=64), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("reply", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("scope", "request_id", name=op.f("pk_idempotency_records")),
    )
    with op.batch_alter_table("idempotency_records", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_idempotency_records_created_at"), ["created_at"], unique=False)

    op.create_table(
        "jobs",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("spec_json", sa.Text(), nullable=False),
        sa.Column("job_data", sa.Text(), nullable=False),
        sa.Column("initial_model_sha256", sa.String(length=64), nullable=True),
        sa.Column("device_selector", sa.Text(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_jobs")),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_created_at_job_id"), ["created_at", "job_id"], unique=False)

    op.create_table(
        "signing_keys",
        sa.Column("key_id", sa.String(length=64), nullable=False),
        sa.Column("key_bytes", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key_id", name=op.f("pk_signing_keys")),
    )
    op.create_table(
        "job_events",
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("sequence", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("time", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("payload_json", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.job_id"], name=op.f("fk_job_events_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "sequence", name=op.f("pk_job_events")),
    )
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=True),
        sa.Column("owner_lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("global_model_sha256", sa.String(length=64), nullable=True),
        sa.Column("metrics_json", sa.Text(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.job_id"], name=op.f("fk_runs_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_runs")),
    )
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_runs_job_id_created_at"), ["job_id", "created_at"], unique=False)

    op.create_table(
        "checkpoints",
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("model_sha256", sa.String(length=64), nullable=False),
        sa.Column("metrics_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_checkpoints_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "round", name=op.f("pk_checkpoints")),
    )
    op.create_table(
        "tasks",
        sa.Column("task_id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("run_id", sa.String(length=32), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("payload_sha256", sa.String(length=64), nullable=True),
        sa.Column("deadline", sa.DateTime(timezone=True), nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column("targeted", sa.Boolean(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint("slots >= 1", name=op.f("ck_tasks_slots_positive")),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.job_id"], name=op.f("fk_tasks_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.run_id"], name=op.f("fk_tasks_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("task_id", name=op.f("pk_tasks")),
    )
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.create_index(
            "ix_tasks_open_job_created",
            ["job_id", "created_at"],
            unique=False,
            sqlite_where=sa.text("state = 'OPEN'"),
            postgresql_where=sa.text("state = 'OPEN'"),
        )
        batch_op.create_index(batch_op.f("ix_tasks_run_id_round"), ["run_id", "round"], unique=False)

    op.create_table(
        "assignments",
        sa.Column("assignment_id", sa.String(length=32), nullable=False),
        sa.Column("task_id", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=False),
        sa.Column("device_id", sa.String(length=32), nullable=False),
        sa.Column("slot", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.task_id"], name=op.f("fk_assignments_task_id_tasks"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("assignment_id", name=op.f("pk_assignments")),
        sa.UniqueConstraint("task_id", "device_id", name=op.f("uq_assignments_task_id_device_id")),
    )
    with op.batch_alter_table("assignments", schema=None) as batch_op:
        batch_op.create_index(
            "ix_assignments_leased_device_job",
            ["device_id", "job_id"],
            unique=False,
            sqlite_where=sa.text("state = 'LEASED'"),
            postgresql_where=sa.text("state = 'LEASED'"),
        )
        batch_op.create_index(
            "ix_assignments_leased_expiry",
            ["lease_expires_at"],
            unique=False,
            sqlite_where=sa.text("state = 'LEASED'"),
            postgresql_where=sa.text("state = 'LEASED'"),
        )
        batch_op.create_index(
            "uq_assignments_active_task_slot",
            ["task_id", "slot"],
            unique=True,
            sqlite_where=sa.text("state IN ('LEASED', 'COMPLETED')"),
            postgresql_where=sa.text("state IN ('LEASED', 'COMPLETED')"),
        )

    op.create_table(
        "task_targets",
        sa.Column("task_id", sa.String(length=32), nullable=False),
        sa.Column("device_id", sa.String(length=32), nullable=False),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.task_id"], name=op.f("fk_task_targets_task_id_tasks"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("task_id", "device_id", name=op.f("pk_task_targets")),
    )
    op.create_table(
        "results",
        sa.Column("result_id", sa.String(length=32), nullable=False),
        sa.Column("assignment_id", sa.String(length=32), nullable=False),
        sa.Column("task_id", sa.String(length=32), nullable=False),
        sa.Column("device_id", sa.String(length=32), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("payload_sha256", sa.String(length=64), nullable=True),
        sa.Column("report_digest", sa.String(length=128), nullable=False),
        sa.Column("error_message", sa.Text(), nullable=False),
        sa.Column("accepted", sa.Boolean(), nullable=False),
        sa.Column("stale", sa.Boolean(), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["assignment_id"],
            ["assignments.assignment_id"],
            name=op.f("fk_results_assignment_id_assignments"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["task_id"], ["tasks.task_id"], name=op.f("fk_results_task_id_tasks"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("result_id", name=op.f("pk_results")),
        sa.UniqueConstraint("assignment_id", name=op.f("uq_results_assignment_id")),
    )
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_results_task_id_device_id"), ["task_id", "device_id"], unique=False
        )


def downgrade() -> None:
    """Revert this revision."""
    with op.batch_alter_table("results", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_results_task_id_device_id"))

    op.drop_table("results")
    op.drop_table("task_targets")
    with op.batch_alter_table("assignments", schema=None) as batch_op:
        batch_op.drop_index(
            "uq_assignments_active_task_slot",
            sqlite_where=sa.text("state IN ('LEASED', 'COMPLETED')"),
            postgresql_where=sa.text("state IN ('LEASED', 'COMPLETED')"),
        )
        batch_op.drop_index(
            "ix_assignments_leased_expiry",
            sqlite_where=sa.text("state = 'LEASED'"),
            postgresql_where=sa.text("state = 'LEASED'"),
        )
        batch_op.drop_index(
            "ix_assignments_leased_device_job",
            sqlite_where=sa.text("state = 'LEASED'"),
            postgresql_where=sa.text("state = 'LEASED'"),
        )

    op.drop_table("assignments")
    with op.batch_alter_table("tasks", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tasks_run_id_round"))
        batch_op.drop_index(
            "ix_tasks_open_job_created",
            sqlite_where=sa.text("state = 'OPEN'"),
            postgresql_where=sa.text("state = 'OPEN'"),
        )

    op.drop_table("tasks")
    op.drop_table("checkpoints")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_runs_job_id_created_at"))

    op.drop_table("runs")
    op.drop_table("job_events")
    op.drop_table("signing_keys")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_created_at_job_id"))

    op.drop_table("jobs")
    with op.batch_alter_table("idempotency_records", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_idempotency_records_created_at"))

    op.drop_table("idempotency_records")
    with op.batch_alter_table("devices", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_devices_last_seen"))
        batch_op.drop_index(batch_op.f("ix_devices_enrolled_at_device_id"))

    op.drop_table("devices")
    op.drop_table("blobs")
    op.drop_table("blob_uploads")
    op.drop_table("blob_chunks")
