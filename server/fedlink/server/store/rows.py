"""Turning rows into domain values, and the keyset page tokens of the listings."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from fedlink.common.errors import InvalidArgument
from fedlink.server.domain import (
    Assignment,
    AssignmentState,
    Checkpoint,
    Device,
    DeviceState,
    Job,
    JobEvent,
    JobState,
    Result,
    ResultStatus,
    Run,
    RunState,
    Task,
    TaskState,
)

MAX_PAGE_SIZE = 1000


def dump_map(value: Mapping[str, str]) -> str:
    """Serialise a string map canonically (sorted keys)."""
    return json.dumps(dict(value), sort_keys=True, separators=(",", ":"))


def load_map(text: str) -> dict[str, str]:
    """Parse a string map written by :func:`dump_map`."""
    loaded: dict[str, str] = json.loads(text)
    return loaded


def encode_page_token(created_at: datetime, item_id: str) -> str:
    """Encode the position after the last item of a page."""
    raw = json.dumps([created_at.isoformat(), item_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_page_token(token: str) -> tuple[datetime, str]:
    """Decode a token made by :func:`encode_page_token`; InvalidArgument if it was not."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        created, item_id = json.loads(raw)
        when = datetime.fromisoformat(created)
        if not isinstance(item_id, str) or when.tzinfo is None:
            raise ValueError(token)
        return when, item_id
    except (ValueError, TypeError, binascii.Error, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"page_token {token!r} is not one this server handed out") from exc


def check_page_size(page_size: int) -> int:
    """Clamp a requested page size into [1, MAX_PAGE_SIZE]; InvalidArgument if negative."""
    if page_size < 0:
        raise InvalidArgument(f"page_size must be >= 0, got {page_size}")
    return min(page_size or 100, MAX_PAGE_SIZE)


def before(
    time_column: sa.ColumnElement[datetime], id_column: sa.ColumnElement[str], when: datetime, item_id: str
) -> sa.ColumnElement[bool]:
    """The keyset condition "comes after (when, item_id) in newest-first order"."""
    return sa.or_(time_column < when, sa.and_(time_column == when, id_column < item_id))


Row = sa.Row[Any]


def device(row: Row) -> Device:
    """Build a Device from a ``devices`` row."""
    return Device(
        device_id=row.device_id,
        device_info=load_map(row.device_info),
        user_info=load_map(row.user_info),
        state=DeviceState(row.state),
        enrolled_at=row.enrolled_at,
        last_seen=row.last_seen,
    )


def job(row: Row) -> Job:
    """Build a Job from a ``jobs`` row."""
    return Job(
        job_id=row.job_id,
        name=row.name,
        state=JobState(row.state),
        spec_json=row.spec_json,
        job_data=row.job_data,
        initial_model_sha256=row.initial_model_sha256,
        initial_model_size_bytes=row.initial_model_size_bytes,
        device_selector=load_map(row.device_selector),
        message=row.message,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )


def run(row: Row) -> Run:
    """Build a Run from a ``runs`` row."""
    return Run(
        run_id=row.run_id,
        job_id=row.job_id,
        state=RunState(row.state),
        owner=row.owner,
        owner_lease_expires_at=row.owner_lease_expires_at,
        round=row.round,
        global_model_sha256=row.global_model_sha256,
        metrics_json=row.metrics_json,
        message=row.message,
        created_at=row.created_at,
        updated_at=row.updated_at,
        workflow_state_json=row.workflow_state_json,
        workflow_state_sha256=row.workflow_state_sha256,
        lease_epoch=row.lease_epoch,
    )


def task(row: Row) -> Task:
    """Build a Task from a ``tasks`` row."""
    return Task(
        task_id=row.task_id,
        job_id=row.job_id,
        run_id=row.run_id,
        round=row.round,
        name=row.name,
        payload_sha256=row.payload_sha256,
        deadline=row.deadline,
        slots=row.slots,
        targeted=bool(row.targeted),
        state=TaskState(row.state),
        created_at=row.created_at,
        model_version=row.model_version,
    )


def assignment(row: Row) -> Assignment:
    """Build an Assignment from an ``assignments`` row."""
    return Assignment(
        assignment_id=row.assignment_id,
        task_id=row.task_id,
        job_id=row.job_id,
        device_id=row.device_id,
        slot=row.slot,
        state=AssignmentState(row.state),
        lease_expires_at=row.lease_expires_at,
        created_at=row.created_at,
    )


def result(row: Row) -> Result:
    """Build a Result from a ``results`` row."""
    return Result(
        result_id=row.result_id,
        assignment_id=row.assignment_id,
        task_id=row.task_id,
        device_id=row.device_id,
        status=ResultStatus(row.status),
        payload_sha256=row.payload_sha256,
        report_digest=row.report_digest,
        error_message=row.error_message,
        accepted=bool(row.accepted),
        stale=bool(row.stale),
        request_id=row.request_id,
        created_at=row.created_at,
    )


def checkpoint(row: Row) -> Checkpoint:
    """Build a Checkpoint from a ``checkpoints`` row."""
    return Checkpoint(
        run_id=row.run_id,
        round=row.round,
        model_sha256=row.model_sha256,
        metrics_json=row.metrics_json,
        created_at=row.created_at,
        workflow_state_json=row.workflow_state_json,
        workflow_state_sha256=row.workflow_state_sha256,
    )


def job_event(row: Row) -> JobEvent:
    """Build a JobEvent from a ``job_events`` row."""
    return JobEvent(
        job_id=row.job_id,
        sequence=row.sequence,
        time=row.time,
        kind=row.kind,
        payload_json=row.payload_json,
    )
