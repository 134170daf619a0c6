"""The Runner's view of the coordinator: a small async interface in domain terms, and its values.

The Runner speaks only to :class:`Transport`; :class:`~fedlink.runner.transport.grpc_transport.GrpcTransport`
implements it over RunnerService, and the simulation adds an in-process one. Normal outcomes come back
as a :class:`Status` in the reply; faults are raised as :mod:`fedlink.common.errors` subclasses.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import TracebackType

from fedlink.common.dxo import DXO, MetaKey
from fedlink.common.status import DeviceStatus

__all__ = [
    "Ack",
    "JobOffer",
    "LeaseAck",
    "ResultReport",
    "Status",
    "TaskOffer",
    "Transport",
    "with_model_version",
]


#: The runner's name for the device protocol's normal outcomes (one enum, shared with the coordinator).
Status = DeviceStatus


@dataclass(frozen=True, slots=True, kw_only=True)
class JobOffer:
    """GetJob's reply."""

    status: Status
    job_id: str = ""
    job_name: str = ""
    #: The job config (JSON text, the NVFlare edge format), OK only.
    job_data: str = ""
    #: How long to wait before asking again (RETRY and NO_JOB), if the coordinator said.
    retry_after: timedelta | None = None
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskOffer:
    """GetTask's reply; for OK the task's input is already a decoded DXO (downloaded if it was a blob)."""

    status: Status
    task_id: str = ""
    task_name: str = ""
    task_data: DXO | None = None
    #: Opaque; goes back with the report and the next GetTask.
    cookie: bytes = b""
    deadline: datetime | None = None
    lease_expires_at: datetime | None = None
    retry_after: timedelta | None = None
    assignment_id: str = ""
    #: The round the task belongs to (0 for workflows without rounds, or a coordinator that does not say).
    round: int = 0
    #: The version of the model ``task_data`` carries, if the coordinator says (then it is also the
    #: data's ``model_version`` meta: see :func:`with_model_version`).
    model_version: int | None = None


def with_model_version(dxo: DXO | None, version: int | None) -> DXO | None:
    """``dxo`` with its ``model_version`` meta set to what the coordinator says the task carries.

    The coordinator's word wins over the model file's own meta (absent from an initial model, or stale
    in a model taken from another job), so that every trainer and filter seeded by the version sees the
    same one. A copy is made only when the meta differs; the arrays are shared, not copied.
    """
    if dxo is None or version is None or dxo.meta.get(MetaKey.MODEL_VERSION) == version:
        return dxo
    return dataclasses.replace(dxo, meta={**dxo.meta, MetaKey.MODEL_VERSION: version})


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultReport:
    """What the Runner reports for a task: a result DXO, or the reason it failed."""

    job_id: str
    task_id: str
    cookie: bytes
    #: The result (None for a failed task).
    result: DXO | None
    #: Why the task failed ("" when it succeeded): the exception's type and message.
    error_message: str = ""
    #: A unique id; a retry with it gets the original reply. The transport fills one in if empty.
    request_id: str = ""

    @property
    def succeeded(self) -> bool:
        """Whether this reports a result (rather than a failure)."""
        return self.result is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class Ack:
    """ReportResult's reply."""

    status: Status
    #: The cookie for the next GetTask of the job.
    cookie: bytes = b""
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseAck:
    """RenewLease's and ReleaseAssignment's reply."""

    status: Status
    lease_expires_at: datetime | None = None


class Transport(ABC):
    """How a Runner reaches the coordinator. An async context manager: ``open`` then ``close``.

    Implementations retry transient faults themselves (with backoff) and raise a
    :class:`~fedlink.common.errors.FedlinkError` only for faults that retrying cannot fix.
    """

    @property
    @abstractmethod
    def device_id(self) -> str:
        """The device's id, known once :meth:`open` returned."""

    @property
    def connection_problem(self) -> str:
        """Why the coordinator cannot be reached now ("" while it answers, or if the transport can't tell)."""
        return ""

    @abstractmethod
    async def open(self) -> None:
        """Connects, enrols if the device has no identity yet, and delivers any result left pending."""

    @abstractmethod
    async def close(self) -> None:
        """Releases the connection; safe to call twice."""

    @abstractmethod
    async def get_job(
        self, *, job_name: str, device_info: dict[str, str], user_info: dict[str, str]
    ) -> JobOffer:
        """Asks for a job (one call; the Runner decides how long to keep asking)."""

    @abstractmethod
    async def get_task(self, *, job_id: str, cookie: bytes) -> TaskOffer:
        """Long-polls for the next task of a job."""

    @abstractmethod
    async def report_result(self, report: ResultReport) -> Ack:
        """Reports a task's outcome, durably: it is delivered even across a restart of the process."""

    @abstractmethod
    async def renew_lease(self, *, job_id: str, task_id: str, cookie: bytes) -> LeaseAck:
        """Extends the lease of the task being worked on."""

    @abstractmethod
    async def release(self, *, job_id: str, task_id: str, cookie: bytes, reason: str) -> LeaseAck:
        """Gives the task back so another device can take it."""

    async def sign_off(self, reason: str) -> None:
        """Tells the coordinator that the device stops taking part for now (best effort: a coordinator
        that cannot be told is not an error). This default, for a transport whose coordinator ends with
        it (the simulation's in-process one), tells nothing."""
        return

    @abstractmethod
    async def download_blob(self, sha256: str, size_bytes: int) -> bytes:
        """Downloads a blob a task refers to (resuming after a dropped stream), checked against its hash."""

    @abstractmethod
    async def upload_blob(self, data: bytes) -> str:
        """Uploads bytes as a blob (resuming a partial upload); returns its sha256."""

    async def __aenter__(self) -> Transport:
        await self.open()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
