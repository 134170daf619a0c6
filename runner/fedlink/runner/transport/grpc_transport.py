"""The gRPC implementation of :class:`~fedlink.runner.transport.base.Transport` (RunnerService).

* **Identity**: enrols once and keeps the device id and credential in ``<state_dir>/identity.json``
  (0600). The Enroll request id is stored *before* the call, so a crash during enrolment gets the
  same device back on restart.
* **One process per state directory**: :meth:`GrpcTransport.open` locks it (see
  :meth:`~fedlink.runner.transport.state.StateDir.lock`) until :meth:`GrpcTransport.close`.
* **TLS** from a CA file, or plaintext only when ``insecure=True`` is given explicitly.
* **Several coordinators**: ``server`` may list several addresses, comma-separated (replicas on one
  shared store; see :mod:`~fedlink.runner.transport.addresses`). Each has its own channel; calls go to
  one address until it fails with UNAVAILABLE or DEADLINE_EXCEEDED, then to the next one at once; when
  every address has failed since the last answer, the transport waits a backoff (full jitter, growing
  with each such round) before it goes round again. An error the coordinator answered is never a
  reason to move. The identity, the pending results and every request id stay as they are: a credential
  one replica issued is valid on the others.
* **Retries**: UNAVAILABLE, DEADLINE_EXCEEDED and ABORTED (and connection failures, which gRPC
  reports as UNAVAILABLE) are retried with exponential backoff and full jitter; RESOURCE_EXHAUSTED,
  INTERNAL and UNKNOWN a few times; everything else cannot succeed by retrying and is raised at once as
  the matching :mod:`fedlink.common.errors` class. Every mutating call carries a request id that stays
  the same across its retries. The caller bounds a call by cancelling it.
* **Connection failures** name the address and the cause (refused, TLS handshake, unknown CA, host name
  mismatch, plaintext against TLS and TLS against plaintext...: see
  :mod:`~fedlink.runner.transport.connection`), once at WARNING, then at DEBUG while the cause stays the
  same. After ``connect_timeout`` without a single answer the call raises
  :class:`~fedlink.common.errors.Unavailable` with the last cause. A CA file that is not PEM is refused
  when the transport is made.
* **Timeouts** are named for what they bound: ``task_wait`` (the GetTask long poll) and
  ``per_request`` (any other call); job discovery is the Runner's ``job_timeout``.
* **Large payloads**: a result over ``blob_threshold_bytes`` goes through UploadBlob (resumed from
  GetBlobUploadStatus after a dropped stream); a task that refers to a blob is fetched with
  DownloadBlob, resumed from the last byte received; both are checked against their SHA-256.
* **Durable results**: :meth:`GrpcTransport.report_result` writes the serialized request to
  ``<state_dir>/pending/`` before the first attempt and deletes it only on OK/STALE/DONE;
  :meth:`GrpcTransport.open` re-sends what a previous process left there, with the same request id.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final, TypeVar

import grpc
from google.protobuf import timestamp_pb2

from fedlink.common.dxo import DXO
from fedlink.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    FedlinkError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from fedlink.common.files import FileLock
from fedlink.common.retry_info import retry_after_of
from fedlink.common.version import PROTOCOL_VERSION
from fedlink.runner.transport.addresses import CoordinatorAddress, fails_over, parse_addresses
from fedlink.runner.transport.backoff import Backoff
from fedlink.runner.transport.base import (
    Ack,
    JobOffer,
    LeaseAck,
    ResultReport,
    Status,
    TaskOffer,
    Transport,
    with_model_version,
)
from fedlink.runner.transport.connection import ConnectionWatch, read_ca_file
from fedlink.runner.transport.state import Identity, StateDir
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as pb
from fedlink.v1 import runner_service_pb2_grpc as pb_grpc

__all__ = ["GrpcTransport", "GrpcTransportConfig"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

_STATUS: Final = {
    pb.RUNNER_STATUS_OK: Status.OK,
    pb.RUNNER_STATUS_RETRY: Status.RETRY,
    pb.RUNNER_STATUS_NO_JOB: Status.NO_JOB,
    pb.RUNNER_STATUS_NO_TASK: Status.NO_TASK,
    pb.RUNNER_STATUS_DONE: Status.DONE,
    pb.RUNNER_STATUS_STALE: Status.STALE,
}
#: Faults that go away by themselves (the coordinator restarting, a network blip): retried forever.
_TRANSIENT: Final = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
)
#: Faults that might go away: retried ``limited_retries`` times, then raised.
_MAYBE_TRANSIENT: Final = frozenset(
    {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
)
_ERRORS: Final[dict[grpc.StatusCode, type[FedlinkError]]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
}
#: Replies after which a pending result is settled (the coordinator has it, or no longer wants it).
_SETTLED: Final = frozenset({Status.OK, Status.STALE, Status.DONE})
#: Faults after which a pending result can never be delivered.
#: Results larger than this (serialized) go through UploadBlob and are reported by hash.
DEFAULT_BLOB_THRESHOLD_BYTES: Final = 2 * 1024**2
_REFUSED: Final = (InvalidArgument, NotFound, FailedPrecondition, PermissionDenied, ResourceExhausted)


@dataclass(frozen=True, slots=True, kw_only=True)
class GrpcTransportConfig:
    """How to reach the coordinator and where the device keeps its state."""

    server: str
    """``host:port`` of the coordinator, or several addresses of its replicas, comma-separated (tried in
    order; see :mod:`~fedlink.runner.transport.addresses`)."""
    state_dir: Path
    """Directory for the identity and pending results (created 0700)."""
    ca_cert: Path | None = None
    """PEM CA bundle that signed the coordinator's certificate (None: the system's roots)."""
    insecure: bool = False
    """Plaintext gRPC; must be asked for explicitly."""
    join_secret: str = field(default="", repr=False)
    """The coordinator's join secret, for the first enrolment."""
    device_info: dict[str, str] = field(default_factory=dict)
    """Sent with Enroll."""
    user_info: dict[str, str] = field(default_factory=dict)
    """Sent with Enroll."""
    task_wait: timedelta = timedelta(seconds=20)
    """How long one GetTask long poll may be held by the coordinator."""
    per_request: timedelta = timedelta(seconds=30)
    """Deadline of every other call (and the margin added to the long poll's)."""
    connect_timeout: timedelta = timedelta(minutes=5)
    """How long the coordinator may stay unreachable (no answer at all) before a call gives up with the
    last cause; 0 waits for ever. Any answer, even a fault, starts the count again."""
    backoff: Backoff = field(default_factory=Backoff)
    """Waits between retries of a failed call."""
    limited_retries: int = 5
    """Retries of RESOURCE_EXHAUSTED, INTERNAL and UNKNOWN before giving up."""
    blob_threshold_bytes: int = DEFAULT_BLOB_THRESHOLD_BYTES
    """Results larger than this are uploaded as a blob rather than sent inline."""
    chunk_bytes: int = 1024**2
    """Chunk size of blob uploads and downloads (the protocol's upper bound is 1 MiB)."""
    max_message_bytes: int = 64 * 1024**2
    """Largest gRPC message sent or received."""
    addresses: tuple[CoordinatorAddress, ...] = field(init=False, repr=False, compare=False)
    """``server`` parsed: the addresses in the order they are tried."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "addresses", parse_addresses(self.server, what="server"))
        if self.insecure and self.ca_cert is not None:
            raise InvalidArgument("insecure and ca_cert exclude each other: pick one")
        if self.connect_timeout < timedelta(0):
            raise InvalidArgument("connect_timeout cannot be negative (0 waits for ever)")
        if not 0 < self.chunk_bytes <= 1024**2:
            raise InvalidArgument(f"chunk_bytes must be in (0, 1 MiB], got {self.chunk_bytes}")


class GrpcTransport(Transport):
    """Speaks RunnerService over one grpc.aio channel (see the module docstring for the behaviour)."""

    def __init__(self, config: GrpcTransportConfig) -> None:
        """Creates the transport (it connects in :meth:`open`).

        Raises:
            InvalidArgument: the CA file cannot be read or holds no PEM certificate.
        """
        self.config = config
        #: Read now: a CA file that is not PEM is a mistake to fix, not a handshake retried for ever.
        self._root_certificates = None if config.ca_cert is None else read_ca_file(config.ca_cert)
        self._addresses = tuple(address.text for address in config.addresses)
        self._watch = ConnectionWatch(
            self._addresses,
            tls=not config.insecure,
            ca_file=config.ca_cert,
            connect_timeout=config.connect_timeout,
            logger=_log,
        )
        self.state = StateDir(config.state_dir)
        self._lock: FileLock | None = None
        #: One channel (and stub) per address, made in :meth:`open`; calls use ``_serving``'s.
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[pb_grpc.RunnerServiceAsyncStub] = []
        self._serving = 0
        #: Addresses that failed over since the last answer, and the rounds of all of them failing.
        self._failed_over: set[int] = set()
        self._rounds = 0
        #: The address calls moved away from, until the new one answers (for the INFO line then).
        self._moved_from: str | None = None
        self._identity: Identity | None = None
        #: Every failed attempt, as ``(rpc, grpc code name)``: for logs, metrics and tests.
        self.failed_attempts: list[tuple[str, str]] = []

    # ---- lifecycle ----
    @property
    def device_id(self) -> str:
        """The device's id (after :meth:`open`)."""
        if self._identity is None or not self._identity.enrolled:
            raise FailedPrecondition("the transport is not open: the device has no identity yet")
        return self._identity.device_id

    async def open(self) -> None:
        """Takes the state directory, connects, enrols if needed, and re-sends what a previous process
        left pending.

        Raises:
            FailedPrecondition: another runner uses the state directory.
        """
        if self._lock is None:
            self._lock = self.state.lock()
        if not self._channels:
            self._channels = [self._make_channel(address) for address in self._addresses]
            self._stubs = [pb_grpc.RunnerServiceStub(channel) for channel in self._channels]
        await self._ensure_identity()
        await self.flush_pending()

    async def close(self) -> None:
        """Closes the channels and lets the state directory go; safe to call twice."""
        channels, self._channels, self._stubs = self._channels, [], []
        for channel in channels:
            await channel.close()
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    @property
    def address(self) -> str:
        """The coordinator address calls go to now (the first until one fails over)."""
        return self._addresses[self._serving]

    def _make_channel(self, address: str) -> grpc.aio.Channel:
        base_ms = int(self.config.backoff.base.total_seconds() * 1000)
        cap_ms = int(self.config.backoff.cap.total_seconds() * 1000)
        options = [
            ("grpc.max_receive_message_length", self.config.max_message_bytes),
            ("grpc.max_send_message_length", self.config.max_message_bytes),
            # gRPC reconnects on its own schedule; align it with ours so a lost coordinator sees
            # connection attempts that follow one documented backoff.
            ("grpc.initial_reconnect_backoff_ms", max(base_ms, 100)),
            ("grpc.min_reconnect_backoff_ms", max(base_ms, 100)),
            ("grpc.max_reconnect_backoff_ms", max(cap_ms, base_ms, 100)),
            ("grpc.enable_retries", 0),  # we retry, with request ids; no second layer below us
            # A name with several A/AAAA records: connect to the first that accepts, one connection
            # (the default policy, said here because the failover above relies on it).
            ("grpc.lb_policy_name", "pick_first"),
        ]
        if self.config.insecure:
            return grpc.aio.insecure_channel(address, options=options)
        credentials = grpc.ssl_channel_credentials(root_certificates=self._root_certificates)
        return grpc.aio.secure_channel(address, credentials, options=options)

    @property
    def connection_problem(self) -> str:
        """Why the coordinator cannot be reached now, with its address or addresses ("" while it
        answers)."""
        return self._watch.describe()

    @property
    def _rpc(self) -> pb_grpc.RunnerServiceAsyncStub:
        if not self._stubs:
            raise FailedPrecondition("the transport is closed")
        return self._stubs[self._serving]

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        if self._identity is None or not self._identity.enrolled:
            raise FailedPrecondition("the device is not enrolled")
        return (("authorization", f"Bearer {self._identity.credential}"),)

    async def _ensure_identity(self) -> None:
        identity = self.state.load_identity()
        if identity is not None and identity.enrolled:
            self._identity = identity
            return
        if identity is None:
            # Saved before the call: a crash between the coordinator's reply and our write then
            # re-enrols with the same request id, which the coordinator answers with the same device.
            identity = Identity(enroll_request_id=str(uuid.uuid4()), server=self.config.server)
            self.state.save_identity(identity)
        try:
            reply = await self._enroll(identity.enroll_request_id)
        except AlreadyExists as exc:
            # The saved request id is answered no more (its first call was too long ago, or was another
            # request): that enrolment's credential never reached us, so enrol anew under a new id.
            _log.info(f"enrolling under a new request id: {exc}")
            identity = Identity(enroll_request_id=str(uuid.uuid4()), server=self.config.server)
            self.state.save_identity(identity)
            reply = await self._enroll(identity.enroll_request_id)
        identity = Identity(
            enroll_request_id=identity.enroll_request_id,
            device_id=reply.device_id,
            credential=reply.device_credential,
            server=self.config.server,
        )
        self.state.save_identity(identity)
        self._identity = identity
        _log.info("enrolled", extra={"device_id": identity.device_id, "server": self.address})

    async def _enroll(self, request_id: str) -> pb.EnrollResponse:
        request = pb.EnrollRequest(
            join_secret=self.config.join_secret,
            device_info=self.config.device_info,
            user_info=self.config.user_info,
            protocol_version=PROTOCOL_VERSION,
            request_id=request_id,
        )
        reply = await self._call("Enroll", lambda: self._rpc.Enroll(request, timeout=self._per_request))
        if reply.state == states_pb2.DEVICE_STATE_PENDING:
            _log.warning(
                f"enrolled as {reply.device_id}, which awaits an operator's approval "
                f"(fedlink device approve {reply.device_id})"
            )
        return reply

    async def sign_off(self, reason: str) -> None:
        """Tells the coordinator the device stops: one attempt within ``per_request``, not retried (the
        runner is on its way out); a fault is logged, and the coordinator notices the silence later."""
        if not self._stubs or self._identity is None or not self._identity.enrolled:
            return
        request = pb.SignOffRequest(reason=reason[:200], request_id=str(uuid.uuid4()))
        try:
            await self._rpc.SignOff(request, metadata=self._metadata(), timeout=self._per_request)
        except grpc.aio.AioRpcError as exc:
            self.failed_attempts.append(("SignOff", exc.code().name))
            _log.info(f"SignOff failed ({exc.code().name}: {exc.details() or ''})")
            return
        _log.info("signed off", extra={"device_id": self._identity.device_id, "reason": reason[:200]})

    @property
    def _per_request(self) -> float:
        return self.config.per_request.total_seconds()

    # ---- the retry loop ----
    async def _call(self, rpc: str, attempt: Callable[[], Awaitable[_T]]) -> _T:
        """Runs ``attempt`` until it succeeds or fails in a way retrying cannot fix.

        Raises:
            FedlinkError: the matching class for a fault retrying cannot fix; Unavailable once the
                coordinator has been unreachable for ``connect_timeout``.
        """
        failures = 0
        limited = 0
        while True:
            try:
                reply = await attempt()
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                self.failed_attempts.append((rpc, code.name))
                # A fault that says when to try again (a rate limit) is retried then, without limit.
                if code in _MAYBE_TRANSIENT and retry_after_of(exc.trailing_metadata()) is None:
                    limited += 1
                if code not in _TRANSIENT and (
                    code not in _MAYBE_TRANSIENT or limited > self.config.limited_retries
                ):
                    self._answered()
                    raise self._error(rpc, exc) from None
                failures += 1
                await asyncio.sleep(self._retry_delay(rpc, exc, failures))
            else:
                self._answered()
                return reply

    def _answered(self) -> None:
        """The current address answered (a reply, or a fault of the coordinator's own)."""
        address = self.address
        self._watch.answered(address)
        if self._moved_from is not None:
            _log.info(
                f"now using the coordinator at {address} (moved from {self._moved_from})",
                extra={"server": address},
            )
            self._moved_from = None
        self._failed_over.clear()
        self._rounds = 0

    def _retry_delay(self, rpc: str, exc: grpc.aio.AioRpcError, retry: int) -> float:
        """The wait before retry number ``retry`` (from 1) of ``rpc``, after it failed with ``exc``; moves
        to the next address first when the fault says this one cannot serve (see the module docstring).

        A connection failure is logged by the watch (once at WARNING per cause and address); any other
        transient fault here, at INFO.

        Raises:
            Unavailable: the coordinator has been unreachable for ``connect_timeout``.
        """
        code, details = exc.code(), exc.details() or ""
        address, connected = self.address, self._connected()
        retry_after = retry_after_of(exc.trailing_metadata())
        moves = len(self._addresses) > 1 and fails_over(code)
        if moves:
            self._failed_over.add(self._serving)
            following = (self._serving + 1) % len(self._addresses)
            if following in self._failed_over:
                # Every address failed since the last answer: back off before going round again.
                delay = self.config.backoff.after(retry_after, self._rounds)
                self._rounds += 1
                self._failed_over.clear()
            else:
                delay = 0.0
            self._serving = following
            self._moved_from = self._moved_from or address
        else:
            delay = self.config.backoff.after(retry_after, retry - 1)
        failure = self._watch.failed(
            rpc,
            code,
            details,
            connected=connected,
            retry=retry,
            delay=delay,
            address=address,
            next_address=self.address,
        )
        if failure is not None:
            return min(delay, self._watch.remaining())
        where = f" at {address}" if len(self._addresses) > 1 else ""
        then = f"trying {self.address} now" if moves and delay <= 0 else f"retry {retry} in {delay:.3f}s"
        _log.info(
            f"{rpc} failed{where} ({code.name}: {details}), {then}",
            extra={
                "rpc": rpc,
                "code": code.name,
                "attempt": retry,
                "delay_s": round(delay, 3),
                "server": address,
            },
        )
        return delay

    def _connected(self) -> bool:
        return bool(self._channels) and (
            self._channels[self._serving].get_state() is grpc.ChannelConnectivity.READY
        )

    def _error(self, rpc: str, exc: grpc.aio.AioRpcError) -> FedlinkError:
        details = exc.details() or exc.code().name
        if exc.code() is grpc.StatusCode.UNAUTHENTICATED and rpc != "Enroll":
            return Unauthenticated(
                f"{rpc}: the coordinator refused this device's credential ({details}). The device was "
                f"revoked or the coordinator lost its store; to enrol again, remove "
                f"{self.state.identity_file}"
            )
        kind = _ERRORS.get(exc.code(), Unavailable)
        return kind(f"{rpc}: {details}")

    # ---- jobs and tasks ----
    async def get_job(
        self, *, job_name: str, device_info: dict[str, str], user_info: dict[str, str]
    ) -> JobOffer:
        """Asks for a job once (transient faults retried)."""
        request = pb.GetJobRequest(
            device_info=device_info,
            user_info=user_info,
            job_name=job_name,
            capabilities=["blob", "sparse", "float16"],
            protocol_version=PROTOCOL_VERSION,
        )
        reply = await self._call(
            "GetJob",
            lambda: self._rpc.GetJob(request, metadata=self._metadata(), timeout=self._per_request),
        )
        return JobOffer(
            status=_status(reply.status, "GetJob"),
            job_id=reply.job_id,
            job_name=reply.job_name,
            job_data=reply.job_data,
            retry_after=reply.retry_after.ToTimedelta() if reply.HasField("retry_after") else None,
            message=reply.message,
        )

    async def get_task(self, *, job_id: str, cookie: bytes) -> TaskOffer:
        """Long-polls for a task for up to ``task_wait``; downloads its input if it is a blob."""
        request = pb.GetTaskRequest(job_id=job_id, cookie=cookie)
        request.wait_timeout.FromTimedelta(self.config.task_wait)
        deadline = (self.config.task_wait + self.config.per_request).total_seconds()
        reply = await self._call(
            "GetTask", lambda: self._rpc.GetTask(request, metadata=self._metadata(), timeout=deadline)
        )
        status = _status(reply.status, "GetTask")
        retry_after = reply.retry_after.ToTimedelta() if reply.HasField("retry_after") else None
        if status is not Status.OK:
            return TaskOffer(status=status, cookie=reply.cookie, retry_after=retry_after)
        version = reply.model_version if reply.HasField("model_version") else None
        return TaskOffer(
            status=status,
            task_id=reply.task_id,
            task_name=reply.task_name,
            task_data=with_model_version(await self._task_input(reply.task_data), version),
            cookie=reply.cookie,
            deadline=_time(reply.deadline, reply.HasField("deadline")),
            lease_expires_at=_time(reply.lease_expire_time, reply.HasField("lease_expire_time")),
            assignment_id=reply.assignment_id,
            round=reply.round,
            model_version=version,
        )

    async def _task_input(self, payload: dxo_pb2.Payload) -> DXO | None:
        where = payload.WhichOneof("location")
        if where == "dxo":
            return DXO.from_proto(payload.dxo)
        if where == "blob":
            return DXO.from_bytes(await self.download_blob(payload.blob.sha256, payload.blob.size_bytes))
        return None

    # ---- results ----
    async def report_result(self, report: ResultReport) -> Ack:
        """Reports durably: on disk first, deleted once the coordinator settled it (OK/STALE/DONE)."""
        request, blob = encode_report(report, self.config.blob_threshold_bytes)
        request_id = request.request_id
        self.state.pending.put(request_id, request.SerializeToString(deterministic=True), blob=blob)
        try:
            return await self._deliver(request, blob)
        except _REFUSED:
            # Retrying cannot help (e.g. a different result for the same task): set it aside.
            self.state.pending.reject(request_id)
            raise

    async def flush_pending(self) -> list[Ack]:
        """Re-sends every result a previous process left unacknowledged, oldest first."""
        acks: list[Ack] = []
        for request_id, data in self.state.pending.items():
            request = pb.ReportResultRequest.FromString(data)
            _log.info(
                "re-sending a pending result", extra={"request_id": request_id, "task_id": request.task_id}
            )
            try:
                acks.append(await self._deliver(request, self.state.pending.blob(request_id)))
            except _REFUSED as exc:
                # The coordinator will never take it (e.g. a different result for the same task): keep
                # it aside for the operator and go on with fresh work.
                moved = self.state.pending.reject(request_id)
                _log.error(
                    "a pending result was refused",
                    extra={"task_id": request.task_id, "error": str(exc), "kept": str(moved)},
                )
        return acks

    async def _deliver(self, request: pb.ReportResultRequest, blob: bytes | None) -> Ack:
        """Sends a request; ``blob``: the bytes of the blob it names, uploaded first (kept with it)."""
        wire = request
        if blob is not None:
            uploaded = await self.upload_blob(blob)
            if uploaded != request.result.blob.sha256:
                raise InvalidArgument(
                    f"pending result {request.request_id}: its kept blob does not match the hash it names"
                )
        elif request.result.WhichOneof("location") == "dxo":
            # An inline DXO over the threshold (a request kept by an earlier runner version).
            data = request.result.dxo.SerializeToString(deterministic=True)
            if len(data) > self.config.blob_threshold_bytes:
                sha = await self.upload_blob(data)
                wire = pb.ReportResultRequest()
                wire.CopyFrom(request)
                wire.result.blob.sha256 = sha
                wire.result.blob.size_bytes = len(data)
        reply = await self._call(
            "ReportResult",
            lambda: self._rpc.ReportResult(wire, metadata=self._metadata(), timeout=self._per_request),
        )
        ack = Ack(status=_status(reply.status, "ReportResult"), cookie=reply.cookie, message=reply.message)
        if ack.status in _SETTLED:
            self.state.pending.done(request.request_id)
        return ack

    # ---- leases ----
    async def renew_lease(self, *, job_id: str, task_id: str, cookie: bytes) -> LeaseAck:
        """Extends the lease of an assignment in progress."""
        request = pb.RenewLeaseRequest(
            job_id=job_id, task_id=task_id, cookie=cookie, request_id=str(uuid.uuid4())
        )
        reply = await self._call(
            "RenewLease",
            lambda: self._rpc.RenewLease(request, metadata=self._metadata(), timeout=self._per_request),
        )
        return LeaseAck(
            status=_status(reply.status, "RenewLease"),
            lease_expires_at=_time(reply.lease_expire_time, reply.HasField("lease_expire_time")),
        )

    async def release(self, *, job_id: str, task_id: str, cookie: bytes, reason: str) -> LeaseAck:
        """Gives an assignment back."""
        request = pb.ReleaseAssignmentRequest(
            job_id=job_id, task_id=task_id, cookie=cookie, reason=reason, request_id=str(uuid.uuid4())
        )
        reply = await self._call(
            "ReleaseAssignment",
            lambda: self._rpc.ReleaseAssignment(
                request, metadata=self._metadata(), timeout=self._per_request
            ),
        )
        return LeaseAck(status=_status(reply.status, "ReleaseAssignment"))

    # ---- blobs ----
    def _transfer_timeout(self, remaining_bytes: int) -> float:
        # A stream's deadline grows with what is left to move: one per_request per 64 MiB, at least one.
        return self._per_request * (1 + max(remaining_bytes, 0) // (64 * 1024**2))

    async def download_blob(self, sha256: str, size_bytes: int) -> bytes:
        """Downloads a blob, resuming from the last byte received after a dropped stream."""
        buffer = bytearray()
        failures = 0
        while True:
            try:
                await self._download_from(sha256, size_bytes, buffer)
            except grpc.aio.AioRpcError as exc:
                self.failed_attempts.append(("DownloadBlob", exc.code().name))
                if exc.code() not in _TRANSIENT:
                    self._answered()
                    raise self._error("DownloadBlob", exc) from None
                failures += 1
                _log.info(
                    "blob download interrupted, resuming", extra={"sha256": sha256, "offset": len(buffer)}
                )
                await asyncio.sleep(self._retry_delay("DownloadBlob", exc, failures))
                continue
            self._answered()
            if size_bytes and len(buffer) != size_bytes:
                raise InvalidArgument(f"blob {sha256}: got {len(buffer)} bytes, expected {size_bytes}")
            if hashlib.sha256(buffer).hexdigest() != sha256:
                raise InvalidArgument(f"blob {sha256}: the downloaded bytes do not match their SHA-256")
            return bytes(buffer)

    async def _download_from(self, sha256: str, size_bytes: int, buffer: bytearray) -> None:
        request = pb.DownloadBlobRequest(
            sha256=sha256, offset=len(buffer), max_chunk_bytes=self.config.chunk_bytes
        )
        stream = self._rpc.DownloadBlob(
            request, metadata=self._metadata(), timeout=self._transfer_timeout(size_bytes - len(buffer))
        )
        async for chunk in stream:
            if chunk.offset != len(buffer):
                raise InvalidArgument(
                    f"blob {sha256}: chunk at offset {chunk.offset}, expected {len(buffer)}"
                )
            buffer.extend(chunk.data)

    async def upload_blob(self, data: bytes) -> str:
        """Uploads ``data`` as a blob, resuming from what the coordinator already holds."""
        sha = hashlib.sha256(data).hexdigest()
        failures = 0
        while True:
            try:
                status = await self._rpc.GetBlobUploadStatus(
                    pb.GetBlobUploadStatusRequest(sha256=sha),
                    metadata=self._metadata(),
                    timeout=self._per_request,
                )
                self._answered()
                if status.complete:
                    return sha
                reply = await self._rpc.UploadBlob(
                    _upload_parts(sha, data, status.received_bytes, self.config.chunk_bytes),
                    metadata=self._metadata(),
                    timeout=self._transfer_timeout(len(data) - status.received_bytes),
                )
                return str(reply.blob.sha256)
            except grpc.aio.AioRpcError as exc:
                self.failed_attempts.append(("UploadBlob", exc.code().name))
                if exc.code() not in _TRANSIENT:
                    self._answered()
                    raise self._error("UploadBlob", exc) from None
                failures += 1
                _log.info("blob upload interrupted, resuming", extra={"sha256": sha})
                await asyncio.sleep(self._retry_delay("UploadBlob", exc, failures))


def encode_report(
    report: ResultReport, blob_threshold_bytes: int
) -> tuple[pb.ReportResultRequest, bytes | None]:
    """The ReportResult request for ``report``, and the blob it names when the result is larger than
    ``blob_threshold_bytes`` (its serialized DXO: serialized once, then kept, hashed and uploaded as is).

    A request id is filled in when the report has none.
    """
    request = pb.ReportResultRequest(
        job_id=report.job_id,
        task_id=report.task_id,
        cookie=report.cookie,
        request_id=report.request_id or str(uuid.uuid4()),
        error_message=report.error_message[:4000],
    )
    if report.result is None:
        request.status = states_pb2.RESULT_STATUS_FAILED
        return request, None
    request.status = states_pb2.RESULT_STATUS_SUCCEEDED
    message = report.result.to_proto()
    if message.ByteSize() <= blob_threshold_bytes:
        request.result.dxo.CopyFrom(message)
        return request, None
    blob = message.SerializeToString(deterministic=True)
    request.result.blob.sha256 = hashlib.sha256(blob).hexdigest()
    request.result.blob.size_bytes = len(blob)
    return request, blob


async def _upload_parts(
    sha: str, data: bytes, offset: int, chunk: int
) -> AsyncIterator[pb.UploadBlobRequest]:
    yield pb.UploadBlobRequest(
        header=dxo_pb2.BlobUploadHeader(sha256=sha, size_bytes=len(data), offset=offset)
    )
    view = memoryview(data)
    for start in range(offset, len(data), chunk):
        yield pb.UploadBlobRequest(chunk=bytes(view[start : start + chunk]))


def _status(value: pb.RunnerStatus.ValueType, rpc: str) -> Status:
    try:
        return _STATUS[value]
    except KeyError:
        raise InvalidArgument(f"{rpc}: the coordinator answered an unknown status {value}") from None


def _time(stamp: timestamp_pb2.Timestamp, present: bool) -> datetime | None:
    return stamp.ToDatetime(tzinfo=UTC) if present else None
