"""The store's tables (SQLAlchemy Core), with a constraint naming convention Alembic can rely on.

The hot path (claims) inserts assignment rows and never updates a shared queue row: a task's free
slots are enforced by a partial unique index over the active assignments, which both SQLite and
PostgreSQL support.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class UtcDateTime(sa.TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend (SQLite keeps naive UTC text that sorts right)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("fedlink stores only timezone-aware datetimes")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert isinstance(value, datetime)
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)

    # SQLite keeps the text SQLAlchemy's DATETIME writes ("YYYY-MM-DD HH:MM:SS.ffffff"). Composed, the
    # hooks above and DATETIME's own processors cost ~3.5 us per value written and ~1.5 us per value
    # read, in the store's thread that holds the GIL: a round of 10,000 devices writes and reads
    # hundreds of thousands. These make the same text, and read it, in one C call each.
    def bind_processor(self, dialect: Dialect) -> Any:
        if dialect.name != "sqlite":
            return super().bind_processor(dialect)
        return _sqlite_datetime_text

    def result_processor(self, dialect: Dialect, coltype: Any) -> Any:
        if dialect.name != "sqlite":
            return super().result_processor(dialect, coltype)
        return _sqlite_datetime_value


# The last two values converted each way, as one tuple (swapped whole: the event loop and the store's
# threads convert concurrently). A batch binds the same ``now`` and deadline in every row, and a round's
# rows read back the same few texts: most conversions repeat one of the two before (a row with two
# timestamps alternates between them).
_last_texts: tuple[datetime | None, str | None, datetime | None, str | None] = (None, None, None, None)
_last_values: tuple[str | None, datetime | None, str | None, datetime | None] = (None, None, None, None)


def _sqlite_datetime_text(value: datetime | None) -> str | None:
    global _last_texts
    if value is None:
        return None
    last = _last_texts
    # Equal instants make equal text, whatever their time zones (a naive value equals no aware one).
    if last[0] == value:
        return last[1]
    if last[2] == value:
        return last[3]
    if value.tzinfo is None:
        raise ValueError("fedlink stores only timezone-aware datetimes")
    utc = value if value.tzinfo is UTC else value.astimezone(UTC)
    text = utc.replace(tzinfo=None).isoformat(" ", "microseconds")
    _last_texts = (value, text, last[0], last[1])
    return text


def _sqlite_datetime_value(value: str | None) -> datetime | None:
    global _last_values
    if value is None:
        return None
    last = _last_values
    if last[0] == value:
        return last[1]
    if last[2] == value:
        return last[3]
    # fromisoformat also reads the shorter text SQLite's CURRENT_TIMESTAMP writes.
    converted = datetime.fromisoformat(value).replace(tzinfo=UTC)
    _last_values = (value, converted, last[0], last[1])
    return converted


def state_is(column: sa.ColumnElement[str], *states: str) -> sa.ColumnElement[bool]:
    """A state test with the states as SQL literals, in the order given.

    The planners use a partial index only when the query's predicate matches the index's: a bound
    parameter hides the value (SQLite, PostgreSQL generic plans), and SQLite wants the same IN list.
    """
    literals: list[sa.ColumnElement[str]] = [sa.literal_column(f"'{state}'") for state in states]
    return column == literals[0] if len(literals) == 1 else column.in_(literals)


#: The most ids bound in one IN list: well below SQLite's bound-parameter limit.
IN_BATCH = 500


def among(column: sa.ColumnElement[str], name: str, *, array: bool) -> sa.ColumnElement[bool]:
    """``column`` is one of the list bound as ``name``: ``= ANY(array)`` on PostgreSQL, else ``IN``.

    An expanding IN renders one bound parameter per item on every execution (milliseconds of Python
    for a batch of a few hundred ids) and a new statement text per list length; an array is one
    parameter and one prepared statement.
    """
    if array:
        return column == sa.any_(sa.bindparam(name, type_=postgresql.ARRAY(column.type)))
    return column.in_(sa.bindparam(name, expanding=True, type_=column.type))


def _id(name: str, *args: Any, **kwargs: Any) -> sa.Column[str]:
    return sa.Column(name, sa.String(32), *args, **kwargs)


def _sha(name: str, nullable: bool = True) -> sa.Column[str]:
    return sa.Column(name, sa.String(64), nullable=nullable)


def _state(name: str = "state") -> sa.Column[str]:
    return sa.Column(name, sa.String(16), nullable=False)


def _time(name: str, nullable: bool = False) -> sa.Column[datetime]:
    return sa.Column(name, UtcDateTime(), nullable=nullable)


def _cascade(target: str) -> sa.ForeignKey:
    return sa.ForeignKey(target, ondelete="CASCADE")


devices = sa.Table(
    "devices",
    metadata,
    _id("device_id", primary_key=True),
    _sha("credential_hash", nullable=False),
    sa.Column("device_info", sa.Text(), nullable=False),
    sa.Column("user_info", sa.Text(), nullable=False),
    _state(),
    _time("enrolled_at"),
    _time("last_seen"),
    #: The job name the device last asked for with GetJob ("": any job); NULL until it first asks.
    #: Sampling picks only devices that asked for a job of that name (or any), so a device that
    #: enrolled and went silent, or runs another job only, is never handed a round it will not take.
    sa.Column("polled_job_name", sa.String(200), nullable=True),
    #: HMAC of the Enroll request that created the device: a retry with the same request_id gets the
    #: credential again only if it is the same request (NULL for devices enrolled before 0007: never).
    _sha("enrolment_digest"),
    sa.UniqueConstraint("credential_hash"),
    sa.Index(None, "enrolled_at", "device_id"),
    sa.Index(None, "last_seen"),
)

jobs = sa.Table(
    "jobs",
    metadata,
    _id("job_id", primary_key=True),
    sa.Column("name", sa.String(200), nullable=False),
    _state(),
    sa.Column("spec_json", sa.Text(), nullable=False),
    sa.Column("job_data", sa.Text(), nullable=False),
    _sha("initial_model_sha256"),
    sa.Column("initial_model_size_bytes", sa.BigInteger(), nullable=True),
    sa.Column("device_selector", sa.Text(), nullable=False),
    sa.Column("message", sa.Text(), nullable=False),
    _time("created_at"),
    _time("updated_at"),
    sa.Index(None, "created_at", "job_id"),
)

runs = sa.Table(
    "runs",
    metadata,
    _id("run_id", primary_key=True),
    _id("job_id", _cascade("jobs.job_id"), nullable=False),
    _state(),
    sa.Column("owner", sa.String(200), nullable=True),
    _time("owner_lease_expires_at", nullable=True),
    sa.Column("round", sa.Integer(), nullable=False),
    _sha("global_model_sha256"),
    sa.Column("metrics_json", sa.Text(), nullable=False),
    sa.Column("message", sa.Text(), nullable=False),
    _time("created_at"),
    _time("updated_at"),
    #: The workflow's own state at the last checkpoint (JSON), and the blob of its arrays.
    sa.Column("workflow_state_json", sa.Text(), nullable=False, server_default="{}"),
    _sha("workflow_state_sha256"),
    #: The fencing counter: bumped whenever a different owner takes the lease; a driver's writes carry
    #: the value it took the lease at and are refused once it moved on (see store/fencing.py).
    sa.Column("lease_epoch", sa.BigInteger(), nullable=False, server_default="0"),
    sa.Index(None, "job_id", "created_at"),
)

tasks = sa.Table(
    "tasks",
    metadata,
    _id("task_id", primary_key=True),
    _id("job_id", _cascade("jobs.job_id"), nullable=False),
    _id("run_id", _cascade("runs.run_id"), nullable=False),
    sa.Column("round", sa.Integer(), nullable=False),
    sa.Column("name", sa.String(200), nullable=False),
    _sha("payload_sha256"),
    _time("deadline"),
    sa.Column("slots", sa.Integer(), nullable=False),
    sa.Column("targeted", sa.Boolean(), nullable=False),
    _state(),
    _time("created_at"),
    #: The version of the model the task carries (NULL: it says none).
    sa.Column("model_version", sa.BigInteger(), nullable=True),
    sa.CheckConstraint("slots >= 1", name="slots_positive"),
    sa.Index(None, "run_id", "round"),
    # Claims look for the oldest OPEN task of a job; closed tasks drop out of this index.
    sa.Index(
        "ix_tasks_open_job_created",
        "job_id",
        "created_at",
        sqlite_where=sa.text("state = 'OPEN'"),
        postgresql_where=sa.text("state = 'OPEN'"),
    ),
    # Claims of untargeted tasks must not walk a job's targeted ones (FedAvg targets every task).
    sa.Index(
        "ix_tasks_open_untargeted_job_created",
        "job_id",
        "created_at",
        sqlite_where=sa.text("state = 'OPEN' AND targeted = 0"),
        postgresql_where=sa.text("state = 'OPEN' AND targeted = false"),
    ),
)

task_targets = sa.Table(
    "task_targets",
    metadata,
    _id("task_id", _cascade("tasks.task_id"), primary_key=True),
    _id("device_id", primary_key=True),
    # A device's claim finds the tasks offered to it by this index, not by scanning the job's tasks.
    sa.Index("ix_task_targets_device_task", "device_id", "task_id"),
)

# The targets of OPEN tasks only: a row leaves when its task closes or is cancelled (task_targets keeps
# the history). A device's claim walks its own offers in task order through the index, so the cost of
# a claim does not grow with the rounds the device has done. The claim still checks the task's state,
# so a row left behind costs a probe, never a wrong claim.
task_offers = sa.Table(
    "task_offers",
    metadata,
    _id("task_id", _cascade("tasks.task_id"), primary_key=True),
    _id("device_id", primary_key=True),
    # Copied from the task, so the index below serves "this device's oldest offer in this job".
    _id("job_id", nullable=False),
    _time("created_at"),
    sa.Index("ix_task_offers_device_job_created", "device_id", "job_id", "created_at", "task_id"),
)

_ACTIVE = sa.text("state IN ('LEASED', 'COMPLETED')")
_LEASED = sa.text("state = 'LEASED'")

assignments = sa.Table(
    "assignments",
    metadata,
    _id("assignment_id", primary_key=True),
    _id("task_id", _cascade("tasks.task_id"), nullable=False),
    # Denormalised from the task so re-delivery finds a device's lease in a job without a join.
    _id("job_id", nullable=False),
    # No foreign key to devices: the claim path stays one index probe lighter, and devices are
    # never deleted (only revoked).
    _id("device_id", nullable=False),
    sa.Column("slot", sa.Integer(), nullable=False),
    _state(),
    _time("lease_expires_at"),
    _time("created_at"),
    sa.UniqueConstraint("task_id", "device_id"),
    # The database itself refuses a task more active holders than it has slots.
    sa.Index(
        "uq_assignments_active_task_slot",
        "task_id",
        "slot",
        unique=True,
        sqlite_where=_ACTIVE,
        postgresql_where=_ACTIVE,
    ),
    sa.Index(
        "ix_assignments_leased_device_job",
        "device_id",
        "job_id",
        sqlite_where=_LEASED,
        postgresql_where=_LEASED,
    ),
    sa.Index(
        "ix_assignments_leased_expiry",
        "lease_expires_at",
        sqlite_where=_LEASED,
        postgresql_where=_LEASED,
    ),
)

results = sa.Table(
    "results",
    metadata,
    _id("result_id", primary_key=True),
    _id("assignment_id", _cascade("assignments.assignment_id"), nullable=False),
    _id("task_id", _cascade("tasks.task_id"), nullable=False),
    _id("device_id", nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    _sha("payload_sha256"),
    sa.Column("report_digest", sa.String(128), nullable=False),
    sa.Column("error_message", sa.Text(), nullable=False),
    sa.Column("accepted", sa.Boolean(), nullable=False),
    sa.Column("stale", sa.Boolean(), nullable=False),
    sa.Column("request_id", sa.String(128), nullable=False),
    _time("created_at"),
    sa.UniqueConstraint("assignment_id"),
    sa.Index(None, "task_id", "device_id"),
)

blobs = sa.Table(
    "blobs",
    metadata,
    _sha("sha256", nullable=False),
    sa.Column("size_bytes", sa.BigInteger(), nullable=False),
    _time("created_at"),
    sa.PrimaryKeyConstraint("sha256"),
)

blob_uploads = sa.Table(
    "blob_uploads",
    metadata,
    sa.Column("upload_key", sa.String(80), primary_key=True),
    # The hash the uploader announced; NULL for a stream whose hash is known only at the end.
    _sha("sha256"),
    sa.Column("size_bytes", sa.BigInteger(), nullable=True),
    sa.Column("received_bytes", sa.BigInteger(), nullable=False),
    _time("created_at"),
)

# The devices that proved they hold a blob's bytes by uploading them whole (the sha256 checked). A
# device sees the status of, and may report as its result, only a blob it holds or was handed as a
# task's input; the bytes are stored once whoever uploads them. A grant goes with its blob.
blob_grants = sa.Table(
    "blob_grants",
    metadata,
    sa.Column("sha256", sa.String(64), _cascade("blobs.sha256"), primary_key=True),
    # No foreign key to devices, as for assignments: devices are never deleted (only revoked).
    _id("device_id", primary_key=True),
    _time("created_at"),
)

# Only the database blob backend fills this; a committed blob's chunks are keyed by its sha256, an
# upload's by its upload key.
blob_chunks = sa.Table(
    "blob_chunks",
    metadata,
    sa.Column("blob_key", sa.String(80), primary_key=True),
    sa.Column("offset", sa.BigInteger(), primary_key=True),
    sa.Column("size", sa.Integer(), nullable=False),
    sa.Column("data", sa.LargeBinary(), nullable=False),
)

checkpoints = sa.Table(
    "checkpoints",
    metadata,
    _id("run_id", _cascade("runs.run_id"), primary_key=True),
    sa.Column("round", sa.Integer(), primary_key=True),
    _sha("model_sha256", nullable=False),
    sa.Column("metrics_json", sa.Text(), nullable=False),
    _time("created_at"),
    sa.Column("workflow_state_json", sa.Text(), nullable=False, server_default="{}"),
    _sha("workflow_state_sha256"),
)

#: Per round and task name: the results accepted, kept by the report path for its result_received
#: events (counting a 10,000-task round's results per report batch had cost a simulation 5 % of its
#: time); and the times the workflow handed the round out again after it fell short, so that a
#: restarted coordinator does not grant a round more retries than its job allows.
round_counts = sa.Table(
    "round_counts",
    metadata,
    _id("run_id", _cascade("runs.run_id"), primary_key=True),
    sa.Column("round", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("accepted", sa.Integer(), nullable=False, server_default="0"),
    sa.Column("retries", sa.Integer(), nullable=False, server_default="0"),
)


job_events = sa.Table(
    "job_events",
    metadata,
    _id("job_id", _cascade("jobs.job_id"), primary_key=True),
    sa.Column("sequence", sa.BigInteger(), primary_key=True, autoincrement=False),
    _time("time"),
    sa.Column("kind", sa.String(64), nullable=False),
    sa.Column("payload_json", sa.Text(), nullable=False),
)

idempotency_records = sa.Table(
    "idempotency_records",
    metadata,
    sa.Column("scope", sa.String(64), primary_key=True),
    sa.Column("request_id", sa.String(128), primary_key=True),
    sa.Column("reply", sa.LargeBinary(), nullable=False),
    _time("created_at"),
    sa.Index(None, "created_at"),
)

signing_keys = sa.Table(
    "signing_keys",
    metadata,
    sa.Column("key_id", sa.String(64), primary_key=True),
    sa.Column("key_bytes", sa.LargeBinary(), nullable=False),
    _time("created_at"),
)
