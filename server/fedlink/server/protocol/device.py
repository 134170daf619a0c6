"""The device protocol (RunnerService) in domain terms, callable in-process.

The gRPC servicer converts protobuf to the arguments here and the replies back; the simulation calls
this layer directly. Every method takes the authenticated device; nothing here trusts a device-set
field for identity. Normal outcomes are a :class:`DeviceStatus` in the reply; faults are raised as
fedlink errors (mapped to gRPC status codes in one place).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from fedlink.common.dxo import DXO
from fedlink.common.errors import (
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from fedlink.common.status import DeviceStatus
from fedlink.common.version import PROTOCOL_VERSION
from fedlink.server.coordination.known_tasks import KnownTasks, remember
from fedlink.server.coordination.notify import TaskNotifier
from fedlink.server.coordination.shared_reads import SharedReads
from fedlink.server.domain import (
    Assignment,
    Clock,
    Device,
    DeviceState,
    Job,
    JobState,
    LeaseLost,
    ReportOutcome,
    ResultStatus,
    Task,
    failure_reason,
    selector_matches,
)
from fedlink.server.protocol.authentication import DeviceAuthenticator
from fedlink.server.protocol.batching import Batcher
from fedlink.server.protocol.cookies import Cookie, CookieSigner
from fedlink.server.protocol.decoding import ResultDecoder
from fedlink.server.protocol.enrolment import Enrolment, EnrolmentPolicy, Enrolments, EnrolRequest
from fedlink.server.protocol.possession import require_held
from fedlink.server.protocol.reads import JobReads
from fedlink.server.protocol.results import ResultValidator
from fedlink.server.store import ClaimRequest, RecordOutcome, ResultReport, StateStore

log = logging.getLogger(__name__)

#: Task payloads kept in memory (a few global models: the current round's and the last ones).
_PAYLOAD_CACHE = 4
#: Assignments handed out by this coordinator kept in memory (for the report's ownership check).
_ASSIGNMENT_CACHE = 100_000
#: Uncached tasks in one claim batch from which the whole round's tasks are read at once.
_ROUND_PREFETCH_MIN = 8
#: Polls answered by one "anything to claim?" read (the store chunks it further).
_CLAIMABLE_BATCH = 5_000
#: Claims, and reports, per store transaction. A round's devices are woken together and claim at once:
#: 10,000 of them took 40 transactions of 256, each a thread hop and a GIL hand-off, on the round's
#: critical path. (A batch's reports are already in memory: a larger batch holds no more of them.)
_WRITE_BATCH = 1024
#: While polls arrive together, how long the "anything to claim?" read waits for more (see Batcher).
_READ_LINGER_SECONDS = 0.01
#: A payload (or what it declares it decodes to) of this size or more is decoded only once the store
#: says its assignment is still open. Smaller ones decode in less time than that read takes (3 to 200
#: ms a batch on a loaded coordinator): they are decoded unless this coordinator knows the assignment
#: is closed, and the store's write judges them.
_ASK_BEFORE_DECODING_BYTES = 1024 * 1024
_FINAL_JOB_STATES = frozenset({JobState.FINISHED, JobState.FAILED, JobState.ABORTED})


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceProtocolConfig:
    """The knobs of the device protocol (a slice of the coordinator's settings)."""

    #: Length of an assignment's lease; long tasks renew it.
    lease: timedelta = timedelta(minutes=5)
    #: Upper bound of a GetTask long poll, whatever the device asks.
    max_task_wait: timedelta = timedelta(seconds=30)
    #: The long-poll wait when the device does not say.
    default_task_wait: timedelta = timedelta(seconds=20)
    #: How long a device waits before asking for a job again when there is none.
    job_retry_after: timedelta = timedelta(seconds=5)
    #: Task payloads up to this size travel inline; larger ones as blob references.
    inline_payload_bytes: int = 2 * 1024 * 1024
    #: Largest result a device may report (inline or as a blob).
    max_result_bytes: int = 2 * 1024**3
    #: Who may enrol, how many and how fast (the join secret among them).
    enrolment: EnrolmentPolicy = field(default_factory=EnrolmentPolicy)
    #: Whether to store the payload of a result the run's driver holds to fold in-process (see
    #: :mod:`fedlink.server.workflows.folding`). Only a store thrown away after the run (the
    #: simulation's) may say False: the result row then keeps its metadata only.
    keep_folded_payloads: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class JobReply:
    """GetJob's reply."""

    status: DeviceStatus
    job: Job | None = None
    retry_after: timedelta | None = None
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskPayload:
    """A task's input DXO: its serialized bytes inline, or only its blob reference when large."""

    sha256: str
    size_bytes: int
    inline: bytes | None


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskReply:
    """GetTask's reply."""

    status: DeviceStatus
    task: Task | None = None
    assignment: Assignment | None = None
    payload: TaskPayload | None = None
    cookie: bytes = b""
    retry_after: timedelta | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultInput:
    """A device's report as the protocol takes it."""

    job_id: str
    task_id: str
    cookie: bytes
    status: ResultStatus
    #: The serialized ``Dxo`` when sent inline (SUCCEEDED only; in-process callers may give only
    #: ``decoded``, serialized here if it must be stored).
    inline: bytes | None = None
    #: The blob holding the serialized ``Dxo`` when uploaded (SUCCEEDED only).
    blob_sha256: str | None = None
    error_message: str = ""
    request_id: str = ""
    #: In-process callers only (the simulation): the result DXO, validated as it is instead of being
    #: decoded again. With ``inline`` it must be exactly what ``inline`` decodes to.
    decoded: DXO | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportReply:
    """ReportResult's reply."""

    status: DeviceStatus
    cookie: bytes = b""
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class SignOffReply:
    """SignOff's reply."""

    status: DeviceStatus
    #: How many assignments the device still held and gave back.
    released: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseReply:
    """RenewLease's and ReleaseAssignment's reply."""

    status: DeviceStatus
    lease_expires_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class _StagedReport:
    """A validated report and, when it came inline, the payload bytes to store with its batch."""

    report: ResultReport
    inline: bytes | None


class ResultListener:
    """Hook for workflows: told about every recorded report, in-process."""

    def result_recorded(self, job_id: str, task: Task) -> None:
        """Called after a report for ``task`` was stored (accepted or failed)."""

    def offer(self, job_id: str, task: Task, request_id: str, update: DXO) -> bool:
        """Offers the validated update of a report about to be recorded to the run's driver, to use
        in-process; True if it holds it (:meth:`settle` follows once the report is recorded)."""
        return False

    def settle(self, job_id: str, task: Task, request_id: str, *, accepted: bool) -> None:
        """Says whether a report :meth:`offer` was given counts (recorded and accepted)."""


def check_protocol_version(version: str) -> None:
    """Refuses a device protocol with another major version than ours.

    Raises:
        InvalidArgument: the version is not "MAJOR.MINOR".
        FailedPrecondition: saying which side to upgrade.
    """
    if not version:
        return  # older clients that do not say; the first incompatible call will fail loudly
    major, _, _ = version.partition(".")
    if not major.isdigit():
        raise InvalidArgument(f"protocol_version {version!r} is not MAJOR.MINOR, e.g. {PROTOCOL_VERSION!r}")
    # Compared as numbers: as strings, "10" < "2" would tell the wrong side to upgrade.
    ours, theirs = int(PROTOCOL_VERSION.partition(".")[0]), int(major)
    if theirs != ours:
        side = "the runner" if theirs < ours else "the coordinator"
        raise FailedPrecondition(
            f"device protocol {version} is not compatible with this coordinator's {PROTOCOL_VERSION}: "
            f"upgrade {side}"
        )


class DeviceProtocol:
    """Serves the device RPCs against the store."""

    def __init__(
        self,
        store: StateStore,
        *,
        signer: CookieSigner,
        enrolment_key: bytes,
        notifier: TaskNotifier,
        validator: ResultValidator,
        clock: Clock,
        config: DeviceProtocolConfig,
        listener: ResultListener | None = None,
        on_outcome: Callable[[str], None] | None = None,
        known_tasks: KnownTasks | None = None,
    ) -> None:
        self._store = store
        self._signer = signer
        self._enrolment_key = enrolment_key
        self._notifier = notifier
        self._validator = validator
        # Parses, checks and decodes result payloads: in a worker thread when large (see decoding.py).
        self._decoder = ResultDecoder()
        self._clock = clock
        self._config = config
        self._listener = listener or ResultListener()
        #: Told "accepted", "failed", "stale" or "rejected" per report (metrics).
        self._on_outcome = on_outcome or (lambda outcome: None)
        self._claims: Batcher[ClaimRequest, Assignment | None] = Batcher(
            self._claim_batch, max_batch=_WRITE_BATCH
        )
        # The "anything to claim?" read of every poll: a round's devices poll together (each right
        # after its report), and one set-based read answers a batch of them.
        self._claimable: Batcher[tuple[str, str], bool] = Batcher(
            self._claimable_batch, max_batch=_CLAIMABLE_BATCH, linger=_READ_LINGER_SECONDS
        )
        self._reads = JobReads(store)  # a round's devices read their job at once: one read serves them
        self._enrolments = Enrolments(store, key=enrolment_key, clock=clock, policy=config.enrolment)
        # What each device last asked GetJob for, as this coordinator recorded it: a device that keeps
        # asking the same costs no write (see _record_poll).
        self._polled: OrderedDict[str, str] = OrderedDict()
        self._polls: Batcher[tuple[str, str], None] = Batcher(self._poll_batch, max_batch=_WRITE_BATCH)
        self._authenticator = DeviceAuthenticator(store)  # one credential read per batch of calls
        self._reports: Batcher[_StagedReport, RecordOutcome] = Batcher(
            self._report_batch, max_batch=_WRITE_BATCH
        )
        # Whether a report's assignment is still open, read before a large payload is decoded.
        self._open: Batcher[str, bool] = Batcher(self._open_batch, max_batch=_WRITE_BATCH)
        # Assignments this coordinator recorded a result for, or released: none takes another result.
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._seen: set[str] = set()
        self._payloads = SharedReads(self._read_payload, _PAYLOAD_CACHE)
        self._tasks = known_tasks if known_tasks is not None else KnownTasks()
        self._prefetched_rounds: set[tuple[str, int]] = set()
        self._assignments: OrderedDict[str, Assignment] = OrderedDict()
        self._accepting = True

    # ---- lifecycle ----
    def stop_accepting(self) -> None:
        """Stops handing out tasks (graceful shutdown); waiting long polls are woken to answer RETRY."""
        self._accepting = False
        self._notifier.notify_all()

    def close(self) -> None:
        """Stops the worker thread that decodes large results (once no call is served any more)."""
        self._decoder.close()

    def note_seen(self, device_id: str) -> None:
        """Records that a device called (written to the store in batches by the maintenance loop)."""
        self._seen.add(device_id)

    def drain_seen(self) -> set[str]:
        """Returns and forgets the devices seen since the last call (for a batched last-seen update)."""
        seen, self._seen = self._seen, set()
        return seen

    # ---- enrolment ----
    async def enroll(
        self,
        *,
        join_secret: str,
        device_info: Mapping[str, str],
        user_info: Mapping[str, str],
        protocol_version: str,
        request_id: str,
    ) -> Enrolment:
        """Enrols a device (see :mod:`fedlink.server.protocol.enrolment` for the rules): the same
        ``request_id`` gives the same device and credential again, shortly after and for the same
        request only."""
        check_protocol_version(protocol_version)
        return await self._enrolments.enroll(
            EnrolRequest(
                join_secret=join_secret,
                device_info=device_info,
                user_info=user_info,
                protocol_version=protocol_version,
                request_id=request_id,
            )
        )

    async def authenticate(self, credential: str | None) -> Device:
        """Returns the device a credential belongs to; Unauthenticated if none, unknown or revoked."""
        device = await self._authenticator.device(credential)
        self._seen.add(device.device_id)
        return device

    # ---- jobs ----
    async def get_job(
        self, device: Device, *, job_name: str, device_info: Mapping[str, str], protocol_version: str
    ) -> JobReply:
        """Offers the oldest pending or running job the device may take part in.

        Selectors match the ``device_info`` recorded at enrolment: the one a request carries is the
        device's own claim (for logs), and would let it claim its way into any job. The job name asked
        for is recorded (the device is sampled only for jobs of that name, or any if it is empty).
        """
        check_protocol_version(protocol_version)
        await self._record_poll(device.device_id, job_name)
        if device.state is DeviceState.PENDING:
            return JobReply(
                status=DeviceStatus.RETRY,
                retry_after=self._config.job_retry_after,
                message=(
                    f"device {device.device_id} awaits an operator's approval "
                    f"(fedlink device approve {device.device_id})"
                ),
            )
        info = device.device_info
        # PENDING is read before RUNNING: a job that starts between the two reads is then in one of them
        # (read the other way round, it was in neither, and the device was told there was no job).
        candidates = [
            job
            for state in (JobState.PENDING, JobState.RUNNING)
            for job in await self._jobs_in(state)
            if (not job_name or job.name == job_name) and selector_matches(job.device_selector, info)
        ]
        if candidates:
            job = min(candidates, key=lambda j: j.created_at)
            return JobReply(status=DeviceStatus.OK, job=job)
        if job_name and await self._job_named_is_over(job_name):
            return JobReply(status=DeviceStatus.DONE, message=f"job {job_name!r} is over")
        return JobReply(
            status=DeviceStatus.NO_JOB,
            retry_after=self._config.job_retry_after,
            message="no job for this device now",
        )

    async def _record_poll(self, device_id: str, job_name: str) -> None:
        """Records what the device asks for before answering, so that a round started right after sees
        it; written only when it changed (every idle device asks every few seconds)."""
        if self._polled.get(device_id) == job_name:
            return
        await self._polls.submit((device_id, job_name))
        remember(self._polled, device_id, job_name, _ASSIGNMENT_CACHE)

    async def _poll_batch(self, polls: Sequence[tuple[str, str]]) -> list[BaseException | None]:
        await self._store.record_polls(polls, self._clock.now())
        return [None] * len(polls)

    async def sign_off(self, device: Device, *, reason: str) -> SignOffReply:
        """The device stops taking part: it is not sampled until it calls again, and the assignments it
        still holds are released (their rounds learn at once)."""
        now = self._clock.now()
        # A call of this device noted before now must not bring it back (see touch_devices), nor may
        # this coordinator's memory of its last GetJob spare the write when it asks again.
        self._seen.discard(device.device_id)
        self._polled.pop(device.device_id, None)
        released = await self._store.sign_off_device(device.device_id, now)
        for assignment in released:
            remember(self._closed, assignment.assignment_id, None, _ASSIGNMENT_CACHE)
            self._listener.result_recorded(assignment.job_id, await self._task(assignment.task_id))
        for job_id in {a.job_id for a in released}:
            self._notifier.notify(job_id)
        log.info(
            "device signed off",
            extra={"device_id": device.device_id, "reason": reason[:200], "released": len(released)},
        )
        return SignOffReply(status=DeviceStatus.OK, released=len(released))

    async def _jobs_in(self, state: JobState) -> list[Job]:
        # Only live jobs are read: a coordinator's history of finished jobs does not slow GetJob.
        return await self._reads.in_state(state)

    async def _job_named_is_over(self, name: str) -> bool:
        """True if a job of this name exists and every job of this name is final (rare: walks history)."""
        # Batched: when a job ends, all its devices ask for the next one at once.
        named = await self._reads.named(name)
        return bool(named) and all(job.state in _FINAL_JOB_STATES for job in named)

    # ---- tasks ----
    async def get_task(
        self, device: Device, *, job_id: str, cookie: bytes, wait: timedelta | None
    ) -> TaskReply:
        """Hands out the device's next task of the job, waiting up to ``wait`` for one."""
        if cookie:
            await self._verify_cookie(cookie, device, job_id)
        job = await self._reads.job(job_id)
        if job.state in _FINAL_JOB_STATES:
            return TaskReply(status=DeviceStatus.DONE)
        if not selector_matches(job.device_selector, device.device_info):
            return TaskReply(status=DeviceStatus.NO_TASK)
        requested = wait if wait is not None and wait > timedelta(0) else self._config.default_task_wait
        budget = min(requested, self._config.max_task_wait).total_seconds()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        notified = False
        while self._accepting:
            waiter = self._notifier.waiter(job_id, device.device_id)
            # Most polls find nothing: find that out with a read, and claim (a write) only when there
            # is something to claim. A device just woken by a notification (a task offered to it)
            # claims at once: the read would only confirm it, and claims are batched.
            if notified or await self._claimable.submit((device.device_id, job_id)):
                request = ClaimRequest(device_id=device.device_id, job_id=job_id)
                assignment = await self._claims.submit(request)
                if assignment is not None:
                    return await self._task_reply(device, job_id, assignment)
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            notified = await waiter.wait(remaining)
            job = await self._reads.job(job_id)
            if job.state in _FINAL_JOB_STATES:
                return TaskReply(status=DeviceStatus.DONE)
        return TaskReply(status=DeviceStatus.RETRY, retry_after=timedelta(seconds=1))

    async def _claimable_batch(self, pairs: Sequence[tuple[str, str]]) -> list[bool | BaseException]:
        return list(await self._store.has_claimable_many(pairs, self._clock.now()))

    async def _claim_batch(self, requests: Sequence[ClaimRequest]) -> list[Assignment | BaseException | None]:
        claimed: list[Assignment | BaseException | None] = list(
            await self._store.claim_tasks(requests, self._clock.now(), self._config.lease)
        )
        assignments = [a for a in claimed if isinstance(a, Assignment)]
        for assignment in assignments:
            remember(self._assignments, assignment.assignment_id, assignment, _ASSIGNMENT_CACHE)
        missing = [a.task_id for a in assignments if a.task_id not in self._tasks]
        if len(missing) >= _ROUND_PREFETCH_MIN:
            await self._prefetch_round(missing[0])
        return claimed

    async def _prefetch_round(self, task_id: str) -> None:
        """Reads all tasks of ``task_id``'s round in one go (once per round): a round's devices claim
        together, and reading their tasks one by one costs a store read per device."""
        task = await self._task(task_id)
        key = (task.run_id, task.round)
        if key in self._prefetched_rounds:
            return
        self._prefetched_rounds.add(key)
        self._tasks.add(await self._store.list_tasks(task.run_id, round=task.round))

    async def _task_reply(self, device: Device, job_id: str, assignment: Assignment) -> TaskReply:
        task = await self._task(assignment.task_id)
        payload = None if task.payload_sha256 is None else await self._payload(task.payload_sha256)
        cookie = self._signer.sign(
            Cookie(device_id=device.device_id, job_id=job_id, assignment_id=assignment.assignment_id)
        )
        return TaskReply(
            status=DeviceStatus.OK, task=task, assignment=assignment, payload=payload, cookie=cookie
        )

    async def _task(self, task_id: str) -> Task:
        # A known copy saves a read per call (see KnownTasks).
        task = self._tasks.get(task_id)
        if task is None:
            task = await self._store.get_task(task_id)
            self._tasks.add([task])
        return task

    async def _payload(self, sha256: str) -> TaskPayload:
        # Every device of a round gets the same model: read it from the blob store once. The devices
        # of a round ask together, so the first asker's read is shared (a future), not repeated.
        return await self._payloads.get(sha256)

    async def _read_payload(self, sha256: str) -> TaskPayload:
        blob = await self._store.blobs.stat(sha256)
        inline = None
        if blob.size_bytes <= self._config.inline_payload_bytes:
            inline = await self._store.blobs.read(sha256)
        return TaskPayload(sha256=blob.sha256, size_bytes=blob.size_bytes, inline=inline)

    async def _verify_cookie(self, cookie: bytes, device: Device, job_id: str) -> Cookie:
        try:
            return self._signer.verify(cookie, device_id=device.device_id, job_id=job_id)
        except InvalidArgument:
            # Looked up only on this error path: an unknown job is NOT_FOUND whatever the cookie says.
            await self._reads.job(job_id)
            raise

    async def _held_assignment(self, device: Device, job_id: str, task_id: str, cookie: bytes) -> Assignment:
        if not cookie:
            raise InvalidArgument("the cookie from GetTask is required")
        said = await self._verify_cookie(cookie, device, job_id)
        if not said.assignment_id:
            raise InvalidArgument(
                "this cookie does not hand out a task: use the one GetTask returned with it"
            )
        # Only the assignment's task and device are checked here, and those never change: the one this
        # coordinator handed out will do. Its state (lease, result) is checked before a payload is
        # decoded (see _decoded_update), and by the store's write.
        assignment = self._assignments.get(said.assignment_id)
        if assignment is None:
            assignment = await self._store.get_assignment(said.assignment_id)
        if assignment.task_id != task_id:
            await self._store.get_task(task_id)  # an unknown task is NOT_FOUND; a known one a mismatch
            raise InvalidArgument(f"the cookie is for task {assignment.task_id}, not {task_id}")
        if assignment.device_id != device.device_id:  # pragma: no cover - the signature binds it
            raise PermissionDenied("this assignment belongs to another device")
        return assignment

    # ---- results ----
    async def report_result(self, device: Device, report: ResultInput) -> ReportReply:
        """Validates and durably records a device's result; OK only once it is stored.

        The payload of a report whose assignment is known to be closed (it has a result, or its task's
        deadline passed), or a large one whose assignment the store says is closed, could not count:
        it is not decoded at all, and the report is recorded as the store judges it (the original
        reply to a retry, STALE, or a conflict) by its content's hash.
        """
        assignment = await self._held_assignment(device, report.job_id, report.task_id, report.cookie)
        task = await self._task(assignment.task_id)
        if report.status is ResultStatus.SUCCEEDED and report.inline is None and report.blob_sha256:
            await require_held(self._store, device.device_id, report.blob_sha256)  # proof of possession
        update: DXO | None = None
        canonical: bytes | None = None  # the decoded inline payload, serialized deterministically
        sent: str | None = None  # the sha256 of a wire report's payload as sent (or its blob's)
        try:
            data, size = await self._result_data(report)
            if report.status is ResultStatus.SUCCEEDED and report.decoded is not None:
                # An in-process caller's DXO is decoded already: there is nothing to spare it.
                update = report.decoded
                (await self._validator.checks(task)).validate(update)
            elif report.status is ResultStatus.SUCCEEDED:
                sent = hashlib.sha256(data).hexdigest() if data is not None else report.blob_sha256
                decoded = await self._decoded_update(assignment, task, report, data, size)
                if decoded is not None:
                    update, canonical = decoded
            del data
        except InvalidArgument:
            self._on_outcome("rejected")
            raise
        # The run's driver may hold the update to fold it now (it needs the report's request id to
        # match it with the stored result); a throwaway store then need not keep its payload.
        held = (
            update is not None
            and bool(report.request_id)
            and self._listener.offer(report.job_id, task, report.request_id, update)
        )
        payload_sha, inline = None, None
        if update is not None and (self._config.keep_folded_payloads or not held):
            payload_sha, inline = self._payload_to_store(report, update, canonical)
        # Identifies the report's content, so a retry without its request_id is still "the same": a wire
        # report by its payload as sent, whether it was decoded (its assignment open) or not. An
        # in-process payload that is not stored is identified by the report's request id.
        content = payload_sha if payload_sha is not None or update is None else f"request:{report.request_id}"
        if sent is not None:
            content = sent
        digest = hashlib.sha256(
            json.dumps([report.status.value, content, report.error_message]).encode()
        ).hexdigest()
        staged = _StagedReport(
            ResultReport(
                assignment_id=assignment.assignment_id,
                device_id=device.device_id,
                status=report.status,
                payload_sha256=payload_sha,
                report_digest=digest,
                request_id=report.request_id or digest,
                error_message=failure_reason(report.error_message),
            ),
            inline,
        )
        try:
            outcome = await self._reports.submit(staged)
        except Conflict:
            remember(self._closed, assignment.assignment_id, None, _ASSIGNMENT_CACHE)  # it has a result
            raise
        remember(self._closed, assignment.assignment_id, None, _ASSIGNMENT_CACHE)
        if held:
            accepted = outcome.outcome is ReportOutcome.ACCEPTED and not outcome.duplicate
            self._listener.settle(report.job_id, task, report.request_id, accepted=accepted)
        next_cookie = self._signer.sign(Cookie(device_id=device.device_id, job_id=report.job_id))
        if not outcome.duplicate:
            stale = outcome.outcome is ReportOutcome.STALE
            failed = report.status is ResultStatus.FAILED
            self._on_outcome("stale" if stale else "failed" if failed else "accepted")
        if outcome.outcome is ReportOutcome.STALE:
            job = await self._reads.job(report.job_id)
            status = DeviceStatus.DONE if job.state in _FINAL_JOB_STATES else DeviceStatus.STALE
            return ReportReply(status=status, cookie=next_cookie, message="recorded, not aggregated")
        if not outcome.duplicate:
            self._listener.result_recorded(report.job_id, task)
            if report.status is ResultStatus.FAILED:
                self._notifier.notify(report.job_id)  # the freed slot may go to another device
        return ReportReply(status=DeviceStatus.OK, cookie=next_cookie)

    async def _result_data(self, report: ResultInput) -> tuple[bytes | None, int]:
        """Checks what a report carries (status, a result when SUCCEEDED, its size); returns the inline
        bytes if any (None for a blob, a failure, or an in-process DXO alone) and the result's size."""
        if report.status is ResultStatus.FAILED:
            return None, 0
        if report.status is not ResultStatus.SUCCEEDED:
            raise InvalidArgument("status must be SUCCEEDED or FAILED")
        limit = self._config.max_result_bytes
        if report.decoded is not None:
            data = report.inline
            size = len(data) if data is not None else report.decoded.nbytes()
        elif report.inline is not None:
            data, size = report.inline, len(report.inline)
        elif report.blob_sha256:
            try:
                blob = await self._store.blobs.stat(report.blob_sha256)
            except NotFound:
                raise NotFound(
                    f"result blob {report.blob_sha256} was not uploaded (or not completed)"
                ) from None
            data, size = None, blob.size_bytes
        else:
            raise InvalidArgument("a SUCCEEDED report needs a result (inline DXO or blob)")
        if size > limit:
            raise ResourceExhausted(f"the result is {size} bytes, over the limit of {limit}")
        return data, size

    async def _decoded_update(
        self, assignment: Assignment, task: Task, report: ResultInput, data: bytes | None, size: int
    ) -> tuple[DXO, bytes] | None:
        """The update a SUCCEEDED report's payload decodes to, checked against the task's model (what
        it declares before anything is decoded, then its values), and its canonical bytes. None if its
        assignment is closed: known here, or (for a large payload) read from the store before it is
        parsed or decoded. A large or many-tensor payload is handled off the event loop."""
        if assignment.assignment_id in self._closed or task.deadline <= self._clock.now():
            return None
        asked = size >= _ASK_BEFORE_DECODING_BYTES
        if asked and not await self._open.submit(assignment.assignment_id):
            return None
        if data is None:
            data = await self._store.blobs.read(report.blob_sha256 or "")
        checks = await self._validator.checks(task)
        # The decoded size is bounded by the task's model already, unless the task has none.
        declared = await self._decoder.declare(data, checks, self._config.max_result_bytes)
        del data
        if (
            not asked
            and declared.decoded_nbytes >= _ASK_BEFORE_DECODING_BYTES
            and not await self._open.submit(assignment.assignment_id)
        ):
            return None
        return await self._decoder.decode(declared, checks)

    async def _open_batch(self, assignment_ids: Sequence[str]) -> list[bool | BaseException]:
        found = await self._store.open_assignments(assignment_ids, self._clock.now())
        return [a in found for a in assignment_ids]

    @staticmethod
    def _payload_to_store(
        report: ResultInput, update: DXO, canonical: bytes | None
    ) -> tuple[str, bytes | None]:
        """The stored payload's sha256 and, unless it is an uploaded blob, the bytes to store with the
        report's batch (one transaction for a batch's payloads): an inline payload as ``canonical``
        (serialized deterministically when decoded), else as the in-process caller gave it."""
        if report.blob_sha256 and report.inline is None and report.decoded is None:
            return report.blob_sha256, None
        if canonical is not None and report.decoded is None:
            return hashlib.sha256(canonical).hexdigest(), canonical
        data = report.inline if report.inline is not None else update.to_bytes()
        return hashlib.sha256(data).hexdigest(), data

    async def _report_batch(self, staged: Sequence[_StagedReport]) -> list[RecordOutcome | BaseException]:
        # Inline payloads were hashed when staged (payload_sha256), and are committed with the reports.
        payloads = [
            (item.report.payload_sha256, item.inline)
            for item in staged
            if item.inline is not None and item.report.payload_sha256 is not None
        ]
        reports = [item.report for item in staged]
        return list(await self._store.record_results(reports, self._clock.now(), payloads=payloads))

    # ---- leases ----
    async def renew_lease(self, device: Device, *, job_id: str, task_id: str, cookie: bytes) -> LeaseReply:
        """Extends the lease of an assignment the device still holds."""
        assignment = await self._held_assignment(device, job_id, task_id, cookie)
        try:
            renewed = await self._store.renew_lease(
                assignment.assignment_id, device.device_id, self._clock.now(), self._config.lease
            )
        except LeaseLost:
            return LeaseReply(status=await self._stale_or_done(job_id))
        return LeaseReply(status=DeviceStatus.OK, lease_expires_at=renewed.lease_expires_at)

    async def release(self, device: Device, *, job_id: str, task_id: str, cookie: bytes) -> LeaseReply:
        """Gives an assignment back so its task can go to another device."""
        assignment = await self._held_assignment(device, job_id, task_id, cookie)
        try:
            await self._store.release_assignment(
                assignment.assignment_id, device.device_id, self._clock.now()
            )
        except LeaseLost:
            return LeaseReply(status=await self._stale_or_done(job_id))
        remember(self._closed, assignment.assignment_id, None, _ASSIGNMENT_CACHE)
        task = await self._task(assignment.task_id)
        self._listener.result_recorded(job_id, task)
        self._notifier.notify(job_id)
        return LeaseReply(status=DeviceStatus.OK)

    async def _stale_or_done(self, job_id: str) -> DeviceStatus:
        job = await self._store.get_job(job_id)
        return DeviceStatus.DONE if job.state in _FINAL_JOB_STATES else DeviceStatus.STALE

    # ---- blobs ----
    async def check_blob_access(self, device: Device, sha256: str) -> None:
        """Refuses a download of a blob that is not the input of one of the device's tasks."""
        if not await self._store.device_may_read_blob(device.device_id, sha256):
            raise PermissionDenied(f"blob {sha256} is not the input of a task assigned to this device")
