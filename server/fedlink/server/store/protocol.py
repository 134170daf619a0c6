"""The state store's interface: intention-revealing async methods that return domain values.

There is one implementation (:class:`fedlink.server.store.sql.SqlStateStore`, SQLAlchemy on SQLite or
PostgreSQL); the Protocol is what the coordinator, the workflows and the services depend on.
Mutating methods take ``now`` explicitly where time decides the outcome (leases, deadlines); the
others stamp times with the store's injected clock. The run-state writes a workflow driver makes take a
``fence`` (its :class:`~fedlink.server.domain.RunFence`): checked in the write's own transaction, it
refuses the write with RunLeaseLost once another coordinator took the run over (``store/fencing.py``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Generic, Protocol, TypeVar

from fedlink.common.errors import FedlinkError, Unauthenticated
from fedlink.server.domain import (
    Assignment,
    Blob,
    Checkpoint,
    Device,
    DeviceState,
    Job,
    JobEvent,
    JobState,
    ReportOutcome,
    Result,
    ResultStatus,
    Run,
    RunFence,
    RunState,
    Task,
)

T = TypeVar("T")

#: How many bytes a blob chunk holds by default when streamed or stored.
CHUNK_SIZE = 1024 * 1024
#: Bytes of small blobs a bulk read (``BlobStore.read_each``) fetches with one query.
READ_BATCH_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class Page(Generic[T]):
    """One page of a listing, and the token for the next one ("" when this is the last page)."""

    items: Sequence[T]
    next_page_token: str


async def all_items(fetch: Callable[[str], Awaitable[Page[T]]]) -> list[T]:
    """Every item of a paged listing: ``fetch(page_token)`` page after page until the last."""
    items: list[T] = []
    token = ""
    while True:
        page = await fetch(token)
        items.extend(page.items)
        token = page.next_page_token
        if not token:
            return items


@dataclass(frozen=True, slots=True, kw_only=True)
class BlobRef:
    """A stored blob's identity and size."""

    sha256: str
    size_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class UploadQuota:
    """How many bytes of uploads an owner (a device) may hold that it has not used yet."""

    #: Bytes of its uploads in flight plus those complete and not used (reported) yet, at most.
    max_bytes: int
    #: When the owner may try again after a refusal (its unused uploads are collected meanwhile).
    retry_after: timedelta | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectedBlobs:
    """What one collection of the blob store deleted."""

    #: Blobs nothing used, and the bytes they held.
    blobs: int = 0
    blob_bytes: int = 0
    #: Partial uploads left idle, and the bytes they had received.
    uploads: int = 0
    upload_bytes: int = 0
    #: Files no row names any more (left by a crash), and their bytes.
    orphan_files: int = 0
    orphan_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Every byte freed."""
        return self.blob_bytes + self.upload_bytes + self.orphan_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class NewJob:
    """What :meth:`StateStore.create_job` needs."""

    name: str
    spec_json: str
    job_data: str
    initial_model_sha256: str | None = None
    initial_model_size_bytes: int | None = None
    device_selector: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class NewTask:
    """What :meth:`StateStore.create_tasks` needs for one task."""

    job_id: str
    run_id: str
    round: int
    name: str
    payload_sha256: str | None
    deadline: datetime
    #: How many devices may hold the task at once (the results it needs); at least 1.
    slots: int = 1
    #: The only devices that may claim the task; empty means any device of the job.
    targets: Sequence[str] = ()
    #: The version of the model the task carries (0: the job's initial model), if it carries one.
    model_version: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class NewDevice:
    """A device to enroll with :meth:`StateStore.enroll_devices`."""

    #: The hash of its credential (never the credential itself).
    credential_hash: str
    device_info: Mapping[str, str] = field(default_factory=dict)
    user_info: Mapping[str, str] = field(default_factory=dict)
    #: None gives it a fresh id.
    device_id: str | None = None
    #: The job name it will ask for with GetJob ("" for any), when known at enrolment (the simulation's
    #: virtual devices are made to take its job): it may be sampled before its first GetJob.
    polled_job_name: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ClaimRequest:
    """One device asking for a task of a job."""

    device_id: str
    job_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultReport:
    """One device's report for an assignment, as :meth:`StateStore.record_results` takes it."""

    assignment_id: str
    #: The authenticated device that sent the report (never a field the device sets itself).
    device_id: str
    status: ResultStatus
    #: The result payload blob (None for a failure).
    payload_sha256: str | None
    #: A digest of the whole report as received (e.g. sha256 of the serialized result), so a retry
    #: without its request_id is still recognised as the same report.
    report_digest: str
    request_id: str
    error_message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordOutcome:
    """What became of a report."""

    outcome: ReportOutcome
    result: Result
    #: True if this report was seen before and the original outcome is returned.
    duplicate: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundSummary:
    """How a round's tasks of one name stand, counted by the store."""

    #: Tasks of the round (all waves, open or not).
    tasks: int
    #: Tasks of the first wave (those created first): the round's sample size.
    first_wave: int
    #: Tasks still open.
    open: int
    #: Tasks with an accepted successful result.
    succeeded: int
    #: Open tasks whose device may still report (no result, not lost).
    owing: int
    #: Open tasks without a result whose device was lost (lease expired, released, failed).
    lost_open: int
    #: The earliest deadline among open tasks, if any are open.
    next_deadline: datetime | None
    #: When the oldest open task no device has claimed yet was created (None: there is none).
    oldest_unclaimed: datetime | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultOutline:
    """One recorded result without its payload or times: who reported what, for which round."""

    round: int
    task_name: str
    device_id: str
    status: ResultStatus
    accepted: bool
    error_message: str


class BlobStore(Protocol):
    """Content-addressed byte strings (sha256), streamed in chunks: never a whole blob in memory."""

    async def put_bytes(self, data: bytes) -> BlobRef:
        """Store ``data`` (once per content) and return its reference."""
        ...

    async def put_many(
        self, datas: Sequence[bytes], *, sha256s: Sequence[str] | None = None
    ) -> list[BlobRef]:
        """Store many small byte strings (once per content) in one transaction; refs in order.

        ``sha256s``, when the caller hashed the bytes already, are their hashes (not computed again).
        """
        ...

    async def put_stream(self, chunks: AsyncIterator[bytes]) -> BlobRef:
        """Store a stream of unknown hash chunk by chunk and return its reference."""
        ...

    async def begin_upload(
        self, sha256: str, size_bytes: int, *, owner: str | None = None, quota: UploadQuota | None = None
    ) -> int:
        """Start (or resume) an upload of a blob with a known hash; return the bytes received so far.

        With an ``owner``, the upload is that owner's own and goes on even if the blob is stored; with
        a ``quota`` too, a new upload that would take the owner's unused uploads over it is refused
        (ResourceExhausted).
        """
        ...

    async def touch(self, sha256: str) -> bool:
        """Tell whether the blob is stored; if it is, it counts as stored just now (not collected yet)."""
        ...

    async def received_bytes(self, sha256: str, *, owner: str | None = None) -> int:
        """Return how many bytes of ``sha256`` the store holds (its size once committed).

        With an ``owner``: the bytes of that owner's own upload only.
        """
        ...

    async def append_upload(self, sha256: str, offset: int, data: bytes, *, owner: str | None = None) -> int:
        """Add ``data`` at ``offset`` (which must equal the bytes received); return the new total."""
        ...

    async def commit_upload(self, sha256: str, *, owner: str | None = None) -> BlobRef:
        """Check the uploaded bytes hash to ``sha256`` and make the blob readable.

        An ``owner``'s upload is checked even if the blob is stored (then kept once, the upload dropped).
        """
        ...

    async def stat(self, sha256: str) -> Blob:
        """Return a stored blob's metadata."""
        ...

    async def exists(self, sha256: str) -> bool:
        """Tell whether a committed blob with this hash is stored."""
        ...

    async def read(self, sha256: str, offset: int = 0, size: int | None = None) -> bytes:
        """Return ``size`` bytes from ``offset`` (to the end if None): for small blobs and ranges."""
        ...

    def iter_chunks(
        self, sha256: str, offset: int = 0, chunk_size: int = CHUNK_SIZE
    ) -> AsyncGenerator[bytes, None]:
        """Yield the blob's bytes from ``offset`` in chunks of at most ``chunk_size`` bytes."""
        ...

    def read_each(
        self, sha256s: Sequence[str], *, batch_bytes: int = READ_BATCH_BYTES
    ) -> AsyncIterator[bytes]:
        """Yield each blob's whole bytes in order, small ones fetched in bulk (NotFound if one is missing)."""
        ...

    async def delete(self, sha256: str) -> int:
        """Delete a blob; return the bytes freed (0 if it was not stored)."""
        ...

    async def gc_unreferenced(self, older_than: datetime) -> int:
        """Delete blobs created before ``older_than`` that nothing references, and stale uploads.

        Returns the bytes freed.
        """
        ...

    async def collect(self, *, unused_before: datetime, idle_uploads_before: datetime) -> CollectedBlobs:
        """Delete blobs nothing has used since before ``unused_before`` and partial uploads idle since
        before ``idle_uploads_before``, with their bytes."""
        ...


class StateStore(Protocol):
    """Everything the coordinator keeps: devices, jobs, runs, tasks, assignments, results, blobs."""

    @property
    def blobs(self) -> BlobStore:
        """The blob store sharing this state store's database."""
        ...

    async def close(self) -> None:
        """Release the database connections."""
        ...

    # ---- devices ----
    async def enroll_device(
        self,
        device_info: Mapping[str, str],
        user_info: Mapping[str, str],
        credential_hash: str,
        *,
        device_id: str | None = None,
        pending: bool = False,
        enrolment_digest: str | None = None,
        max_devices: int | None = None,
    ) -> Device:
        """Enroll a device under the hash of its credential (never the credential itself): PENDING if
        ``pending``, else ONLINE; ResourceExhausted if ``max_devices`` devices that are not revoked
        are enrolled already."""
        ...

    async def enrolment_digest(self, device_id: str) -> str | None:
        """The digest a device was enrolled with (None if none was kept); NotFound if unknown."""
        ...

    async def enroll_devices(self, new_devices: Sequence[NewDevice]) -> list[Device]:
        """Enroll many devices in one transaction (all or none; AlreadyExists if any is enrolled)."""
        ...

    async def authenticate_device(self, credential_hash: str) -> Device:
        """Return the device with this credential; Unauthenticated if unknown or revoked."""
        ...

    async def authenticate_devices(self, credential_hashes: Sequence[str]) -> list[Device | Unauthenticated]:
        """Authenticate many credentials with one read: per hash, in order, its device or the
        Unauthenticated that :meth:`authenticate_device` would raise for it."""
        ...

    async def get_device(self, device_id: str) -> Device:
        """Return a device; NotFound if unknown."""
        ...

    async def touch_devices(self, device_ids: Sequence[str], now: datetime) -> None:
        """Record that these devices were seen at ``now`` (OFFLINE ones come back ONLINE); one seen at
        ``now`` or later already is left alone."""
        ...

    async def record_polls(self, polls: Sequence[tuple[str, str]], now: datetime) -> None:
        """Record that each ``(device_id, job_name)`` asked for a job of that name ("" for any) at
        ``now``; the device is seen then too."""
        ...

    async def sign_off_device(self, device_id: str, now: datetime) -> list[Assignment]:
        """An ONLINE device goes OFFLINE at once, and its LEASED assignments are RELEASED (returned)."""
        ...

    async def mark_offline(self, older_than: datetime) -> int:
        """Move ONLINE devices not seen since ``older_than`` and holding no lease to OFFLINE; return how
        many moved."""
        ...

    async def approve_device(self, device_id: str) -> Device:
        """Make a PENDING device ONLINE (an approved one is returned as it is; a revoked one is an
        IllegalTransition)."""
        ...

    async def revoke_device(self, device_id: str) -> Device:
        """Revoke a device's credential for good."""
        ...

    async def list_devices(
        self, *, page_size: int = 100, page_token: str = "", state: DeviceState | None = None
    ) -> Page[Device]:
        """List devices, newest enrollment first."""
        ...

    async def online_devices(
        self, *, with_info: bool, job_name: str | None = None
    ) -> list[tuple[str, Mapping[str, str]]]:
        """Every ONLINE device's id, with its device_info if ``with_info`` (else an empty map), in
        no particular order: what a workflow samples a round's devices from, in one read. With
        ``job_name``, only the devices whose last GetJob asked for that name or for any job."""
        ...

    # ---- jobs and runs ----
    async def create_job(self, new_job: NewJob) -> Job:
        """Create a PENDING job."""
        ...

    async def get_job(self, job_id: str) -> Job:
        """Return a job; NotFound if unknown."""
        ...

    async def list_jobs(
        self, *, page_size: int = 100, page_token: str = "", state: JobState | None = None
    ) -> Page[Job]:
        """List jobs, newest first, with a stable keyset page token."""
        ...

    async def set_job_state(
        self,
        job_id: str,
        target: JobState,
        message: str = "",
        *,
        fence: RunFence | None = None,
        event: tuple[str, str] | None = None,
    ) -> Job:
        """Move a job to ``target``; IllegalTransition if its state machine has no such edge (with a
        ``fence``: RunLeaseLost unless it still holds the job's run). With an ``event`` (kind, payload
        JSON), that event is appended in the same transaction: a watcher never sees the one without
        the other."""
        ...

    async def delete_job(self, job_id: str) -> int:
        """Delete a final job with everything it owns; return the blob bytes freed."""
        ...

    async def acquire_job_run(self, job_id: str, *, owner: str, now: datetime, lease: timedelta) -> Run:
        """The run that drives the job, with ``owner`` holding its lease: created by the first
        coordinator to ask (two asking at once make one run), renewed for its owner, taken over once
        its lease lapsed, RunLeaseHeld while another owner's lease holds, RunEnded once it ended."""
        ...

    async def get_run(self, run_id: str) -> Run:
        """Return a run; NotFound if unknown."""
        ...

    async def get_current_run(self, job_id: str) -> Run:
        """Return the job's latest run; NotFound if it has none."""
        ...

    async def acquire_run_lease(self, run_id: str, *, owner: str, now: datetime, lease: timedelta) -> Run:
        """Take or renew the lease to drive a run; RunLeaseHeld if another owner's lease holds, RunEnded
        if it ended. Taken from another owner, the run's ``lease_epoch`` goes up: the old owner's fenced
        writes fail."""
        ...

    async def renew_run_lease(self, fence: RunFence, *, now: datetime, lease: timedelta) -> Run:
        """Extend the lease ``fence`` took to ``now + lease``; RunLeaseLost if another owner took the
        run since, or it ended."""
        ...

    async def finish_run(
        self, run_id: str, target: RunState, message: str = "", *, fence: RunFence | None = None
    ) -> Run:
        """Move a run to a final state (with a ``fence``: RunLeaseLost unless it still holds the run)."""
        ...

    async def save_checkpoint(
        self,
        run_id: str,
        round: int,
        model_sha256: str,
        metrics_json: str,
        *,
        keep_last: int,
        state_json: str = "{}",
        state_sha256: str | None = None,
        fence: RunFence | None = None,
        events: Sequence[tuple[str, str]] = (),
    ) -> Checkpoint:
        """Record a round's model, metrics and workflow state on the run, in one transaction; keep only
        the last ``keep_last`` checkpoints (the blobs of the others are freed unless still used).
        With a ``fence``: RunLeaseLost, and nothing recorded, unless it still holds the run. ``events``
        (kind, payload JSON) are appended to the run's job in the same transaction."""
        ...

    async def list_checkpoints(self, run_id: str) -> Sequence[Checkpoint]:
        """Return a run's kept checkpoints, oldest round first."""
        ...

    async def append_job_event(
        self, job_id: str, kind: str, payload_json: str, *, fence: RunFence | None = None
    ) -> JobEvent:
        """Append a progress event to a job (with a ``fence``: only while it holds the job's run)."""
        ...

    async def list_job_events(
        self, job_id: str, *, after_sequence: int = 0, limit: int = 1000
    ) -> Sequence[JobEvent]:
        """Return a job's events after ``after_sequence``, in order."""
        ...

    async def prune_job_events(self, *, finished_before: datetime, keep_per_job: int) -> int:
        """Trim finished jobs' events: one finished before ``finished_before`` keeps its last event, any
        other its newest ``keep_per_job``; a pending or running job keeps all. Returns how many went."""
        ...

    async def live_jobs_using_blob(self, sha256: str) -> list[str]:
        """The pending or running jobs whose initial model, run, task, result or checkpoint is the blob."""
        ...

    # ---- tasks ----
    async def create_tasks(
        self, new_tasks: Sequence[NewTask], *, fence: RunFence | None = None
    ) -> Sequence[Task]:
        """Create OPEN tasks in one transaction (with a ``fence``: only while it holds their run)."""
        ...

    async def get_task(self, task_id: str) -> Task:
        """Return a task; NotFound if unknown."""
        ...

    async def list_tasks(self, run_id: str, *, round: int | None = None) -> Sequence[Task]:
        """Return a run's tasks (of one round if given), oldest first."""
        ...

    async def close_task(self, task_id: str, *, fence: RunFence | None = None) -> Task:
        """Close an OPEN task: later reports for it are stale (with a ``fence``: only while it holds the
        run)."""
        ...

    async def cancel_task(self, task_id: str, *, fence: RunFence | None = None) -> Task:
        """Cancel an OPEN task (with a ``fence``: only while it holds the run)."""
        ...

    async def cancel_job_tasks(self, job_id: str, *, fence: RunFence | None = None) -> int:
        """Cancel every OPEN task of a job; return how many (with a ``fence``: only while it holds the
        job's run)."""
        ...

    # ---- claims and leases ----
    async def claim_tasks(
        self, requests: Sequence[ClaimRequest], now: datetime, lease: timedelta
    ) -> list[Assignment | None]:
        """Serve many task requests in one transaction; None where the device has nothing to do."""
        ...

    async def claim_task(
        self, device_id: str, job_id: str, now: datetime, lease: timedelta
    ) -> Assignment | None:
        """Serve one task request; None if nothing is available for the device."""
        ...

    async def has_claimable(self, device_id: str, job_id: str, now: datetime) -> bool:
        """Tell, without writing, whether a claim by the device could get anything now."""
        ...

    async def has_claimable_many(self, pairs: Sequence[tuple[str, str]], now: datetime) -> list[bool]:
        """:meth:`has_claimable` for many ``(device_id, job_id)`` pairs at once, in their order."""
        ...

    async def get_assignment(self, assignment_id: str) -> Assignment:
        """Return an assignment; NotFound if unknown."""
        ...

    async def open_assignments(self, assignment_ids: Sequence[str], now: datetime) -> set[str]:
        """Those of the assignments a report would be counted for at ``now`` (unknown ids are left out):
        LEASED under a lease not yet ended, of an OPEN task whose deadline has not passed. An
        assignment that is not open never opens again."""
        ...

    async def renew_lease(
        self, assignment_id: str, device_id: str, now: datetime, lease: timedelta
    ) -> Assignment:
        """Extend a held lease to ``now + lease``; LeaseLost if it is no longer held."""
        ...

    async def release_assignment(self, assignment_id: str, device_id: str, now: datetime) -> Assignment:
        """Give a held assignment back, freeing its slot; LeaseLost if it is no longer held."""
        ...

    async def expire_leases(self, now: datetime) -> Sequence[Assignment]:
        """Expire every LEASED assignment whose lease ended at or before ``now``; return them."""
        ...

    async def list_assignments(self, *, task_ids: Sequence[str]) -> Sequence[Assignment]:
        """Return every assignment of these tasks (all states), oldest first."""
        ...

    async def task_targets(self, *, task_ids: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """Return the devices each targeted task is offered to (untargeted tasks are absent)."""
        ...

    async def device_may_read_blob(self, device_id: str, sha256: str) -> bool:
        """True if the blob is the input of a task the device holds (or held) an assignment for."""
        ...

    async def grant_blob(self, sha256: str, device_id: str) -> bool:
        """Record that the device proved it holds the stored blob; False if the blob is not stored."""
        ...

    async def device_holds_blob(self, device_id: str, sha256: str) -> bool:
        """True if the blob is stored and the device proved it holds it or may read it (a task input)."""
        ...

    async def round_summary(self, *, run_id: str, round: int, name: str) -> RoundSummary:
        """Count a round's tasks of one name by what their devices did."""
        ...

    async def result_outlines(self, run_id: str) -> list[ResultOutline]:
        """Every result recorded in the run (stale ones too), outlined, in no particular order."""
        ...

    async def close_round_tasks(
        self, *, run_id: str, round: int, name: str, fence: RunFence | None = None
    ) -> int:
        """Close every OPEN task of a round of one name; return how many closed (with a ``fence``: only
        while it holds the run)."""
        ...

    async def close_tasks(self, task_ids: Sequence[str], *, fence: RunFence | None = None) -> int:
        """Close those of these tasks that are OPEN, in one transaction; return how many closed (with a
        ``fence``: only while it holds their run)."""
        ...

    async def round_retries(self, *, run_id: str, round: int, name: str) -> int:
        """How many retries of a round of one name :meth:`count_round_retry` counted."""
        ...

    async def count_round_retry(
        self, *, run_id: str, round: int, name: str, fence: RunFence | None = None
    ) -> int:
        """Count one more retry of a round of one name; return the retries counted, this one included
        (with a ``fence``: only while it holds the run)."""
        ...

    async def count_devices_by_state(self) -> dict[DeviceState, int]:
        """Return the number of devices in each state (states with none are left out)."""
        ...

    async def count_jobs_by_state(self) -> dict[JobState, int]:
        """Return the number of jobs in each state (states with none are left out)."""
        ...

    # ---- results ----
    async def record_results(
        self, reports: Sequence[ResultReport], now: datetime, *, payloads: Sequence[tuple[str, bytes]] = ()
    ) -> list[RecordOutcome | FedlinkError]:
        """Record many reports in one transaction; each item is an outcome or the error it earned.

        ``payloads``: (sha256, bytes) of the reports' inline results, stored as blobs in the same
        transaction.
        """
        ...

    async def record_result(self, report: ResultReport, now: datetime) -> RecordOutcome:
        """Record one report (idempotent); raises what :meth:`record_results` would put in its slot."""
        ...

    async def list_results(
        self,
        *,
        task_id: str | None = None,
        task_ids: Sequence[str] | None = None,
        run_id: str | None = None,
        round: int | None = None,
        accepted_only: bool = True,
    ) -> Sequence[Result]:
        """Return results of a task, of these tasks, or of a run's round, ordered by device_id
        (canonical order; for ``task_ids``, within each batch of a few hundred)."""
        ...

    # ---- coordinator secrets and idempotency ----
    async def get_or_create_signing_key(self) -> bytes:
        """Return the coordinator's 32-byte cookie signing key, creating it once."""
        ...

    async def remember_reply(self, scope: str, request_id: str, reply: bytes) -> bytes:
        """Keep the reply to a mutating request; return the reply kept first if one already was."""
        ...

    async def recall_reply(self, scope: str, request_id: str) -> bytes | None:
        """Return the reply kept for this request, or None if it was never answered."""
        ...

    async def forget_replies(self, older_than: datetime) -> int:
        """Drop idempotency records kept before ``older_than``; return how many."""
        ...
