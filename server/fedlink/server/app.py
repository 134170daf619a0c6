"""The coordinator's composition root: ``async with Coordinator(settings) as c: await c.wait_closed()``.

It opens the store, builds the device and control protocols over it, serves both gRPC services (plus
health and reflection) and runs the background services in one task group. ``stop()`` is graceful:
health reports NOT_SERVING, no new tasks are handed out, in-flight calls get the grace period, then
the services stop and the store closes.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import AsyncExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from fedlink.common import dtypes
from fedlink.common.errors import PermissionDenied, Unauthenticated
from fedlink.server.api.admission import RefusedBytes, UnauthenticatedReads, gated_health_handler
from fedlink.server.api.control_servicer import ControlServicer
from fedlink.server.api.rpc import Principal, method_handlers
from fedlink.server.api.runner_servicer import RunnerServicer
from fedlink.server.core import CoordinatorCore
from fedlink.server.credentials import (
    constant_time_equals,
    hash_credential,
    resolve_admin_token,
    resolve_join_secret,
)
from fedlink.server.domain import Clock, DeviceState, SystemClock
from fedlink.server.memory import map_large_blocks
from fedlink.server.protocol.device import DeviceProtocol
from fedlink.server.settings import CoordinatorSettings
from fedlink.server.store import UploadQuota
from fedlink.server.store.sql import SqlStateStore
from fedlink.server.telemetry import MetricsServer, Telemetry
from fedlink.server.tls import certificate_names, ensure_self_signed, load_server_credentials
from fedlink.v1 import control_service_pb2, runner_service_pb2

log = logging.getLogger(__name__)

RUNNER_SERVICE = runner_service_pb2.DESCRIPTOR.services_by_name["RunnerService"]
CONTROL_SERVICE = control_service_pb2.DESCRIPTOR.services_by_name["ControlService"]
#: Calls grpc-core may hold for the server before cancelling new ones (its defaults: 1,000 and 3,000).
_MAX_PENDING_CALLS = 100_000
#: What a device awaiting approval may call: GetJob (which tells it so) and SignOff.
_PENDING_DEVICE_METHODS = frozenset({"GetJob", "SignOff"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """Where the coordinator listens and how to reach it."""

    address: str
    port: int
    #: The CA certificate clients must trust (self-signed setup), or None.
    ca_cert: Path | None
    insecure: bool
    #: The names and addresses the self-signed certificate covers (empty: plaintext, or one's own).
    tls_names: tuple[str, ...] = ()


class _DeviceAuth:
    """Authenticates RunnerService calls by device credential.

    Nothing is cached: every call is checked against the store (concurrent calls share one read), so
    a device revoked through any coordinator sharing the database is refused from its next call on.
    """

    def __init__(self, protocol: DeviceProtocol) -> None:
        self._protocol = protocol

    async def __call__(self, token: str | None, method: str) -> Principal:
        if method == "Enroll":
            return Principal("anonymous")
        device = await self._protocol.authenticate(token)
        if device.state is DeviceState.PENDING and method not in _PENDING_DEVICE_METHODS:
            # Nothing of an unapproved device is stored or handed to it (no uploads, no tasks).
            raise PermissionDenied(
                f"device {device.device_id} awaits an operator's approval "
                f"(fedlink device approve {device.device_id})"
            )
        return Principal("device", device_id=device.device_id, device=device)


class _AdminAuth:
    """Authenticates ControlService calls by the admin credential; a device credential is refused."""

    def __init__(self, admin_token: str, store: SqlStateStore) -> None:
        self._admin_token = admin_token
        self._store = store

    async def __call__(self, token: str | None, method: str) -> Principal:
        if not token:
            raise Unauthenticated("this call needs the admin credential: authorization: Bearer <admin token>")
        if constant_time_equals(token, self._admin_token):
            return Principal("admin")
        try:
            await self._store.authenticate_device(hash_credential(token))
        except Exception:
            raise Unauthenticated("the admin credential is wrong") from None
        raise PermissionDenied("a device credential cannot use the control API")


class Coordinator:
    """The fedlink coordinator service."""

    def __init__(self, settings: CoordinatorSettings, *, clock: Clock | None = None) -> None:
        self.settings = settings
        self._clock = clock or SystemClock()
        self._stack = AsyncExitStack()
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self._closed = asyncio.Event()
        self._metrics_server: MetricsServer | None = None
        self._failing: asyncio.Task[None] | None = None
        #: Set once stopping starts: health stays NOT_SERVING whatever the store does from then on.
        self._stopping = False
        self._health_updates: set[asyncio.Task[None]] = set()
        #: Why the coordinator stopped by itself (its background loops gave up), if it did.
        self.failure: BaseException | None = None
        self.telemetry = Telemetry()
        self.endpoint: Endpoint | None = None
        self.admin_token = ""
        self.core: CoordinatorCore | None = None
        self.store: SqlStateStore | None = None
        self.device_protocol: DeviceProtocol | None = None

    async def __aenter__(self) -> Coordinator:
        try:
            await self.start()
        except BaseException:
            await self.stop(grace=0)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Opens the store, starts the services and the gRPC server."""
        s = self.settings
        # Both secrets first: a secret file that is missing or unsafe is refused before anything starts.
        join_secret = resolve_join_secret(s)
        self.admin_token = resolve_admin_token(s)
        # The first bfloat16 tensor a device sends would import ml_dtypes (a second or more) on the event
        # loop, every call waiting: it is imported before serving instead.
        dtypes.native_bfloat16()
        map_large_blocks()  # a refused large payload's memory goes back to the system (memory.py)
        core = CoordinatorCore(
            s,
            clock=self._clock,
            join_secret=join_secret,
            on_result_outcome=self.telemetry.count_result,
            telemetry=self.telemetry if s.metrics_address else None,
        )
        core.on_failure.append(self._loops_failed)
        self.core = core
        self._stack.push_async_callback(core.stop)
        await core.start()
        store = core.store
        self.store = store
        self.device_protocol = core.device_protocol
        device_auth = _DeviceAuth(core.device_protocol)
        device_protocol, control_protocol = core.device_protocol, core.control_protocol
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", s.max_message_bytes),
                ("grpc.max_send_message_length", s.max_message_bytes),
                # grpc-core cancels calls beyond 1,000 pending (3,000 hard) requests: thousands of
                # devices in GetTask long polls need far more (bench/protocol_bench.py, idle part).
                ("grpc.server.max_pending_requests", _MAX_PENDING_CALLS),
                ("grpc.server.max_pending_requests_hard_limit", 2 * _MAX_PENDING_CALLS),
            ]
        )
        server.add_generic_rpc_handlers(
            (
                method_handlers(
                    RUNNER_SERVICE,
                    RunnerServicer(
                        device_protocol,
                        store,
                        max_blob_bytes=2 * 1024**3,
                        # A device that filled it waits for the next collection of unused uploads.
                        upload_quota=UploadQuota(
                            max_bytes=s.device_upload_quota_bytes, retry_after=s.collection_interval
                        ),
                    ),
                    device_auth,
                    self.telemetry,
                    refused=RefusedBytes(),  # a device that keeps sending what is refused waits
                ),
                method_handlers(
                    CONTROL_SERVICE,
                    ControlServicer(
                        control_protocol,
                        store.blobs,
                        max_model_bytes=2 * 1024**3,
                    ),
                    _AdminAuth(self.admin_token, store),
                    self.telemetry,
                ),
            )
        )
        # Health checks need no credential: their requests are read a few at once, small and quick,
        # through a gate of their own (an Enroll flood must not delay them). See api/admission.py.
        health_reads = UnauthenticatedReads(slots=4, read_timeout=timedelta(seconds=1))
        server.add_generic_rpc_handlers((gated_health_handler(self._health, health_reads),))
        reflection.enable_server_reflection(
            (
                RUNNER_SERVICE.full_name,
                CONTROL_SERVICE.full_name,
                reflection.SERVICE_NAME,
                health.SERVICE_NAME,
            ),
            server,
        )
        ca_cert: Path | None = None
        tls_names: tuple[str, ...] = ()
        if s.insecure:
            port = server.add_insecure_port(s.listen_address)
        else:
            if s.tls_cert is not None and s.tls_key is not None:
                cert, key_path = s.tls_cert, s.tls_key
            else:
                # On 0.0.0.0 or [::] devices come by the host's names and addresses: the certificate
                # covers them too (tls_hostnames adds others; tls_cert/tls_key brings one's own).
                tls_names = certificate_names(s.listen_address, s.tls_hostnames)
                material = ensure_self_signed(s.tls_dir, tls_names)
                cert, key_path, ca_cert = material.cert_path, material.key_path, material.ca_cert_path
                log.info(
                    f"self-signed TLS certificate for {', '.join(tls_names)}; for other names: "
                    f"--tls-hostnames (or your own certificate: --tls-cert/--tls-key)",
                    extra={"tls_names": ",".join(tls_names), "cert": str(cert)},
                )
            port = server.add_secure_port(
                s.listen_address, load_server_credentials(cert, key_path, s.tls_client_ca)
            )
        if port == 0:
            raise OSError(f"cannot listen on {s.listen_address}")
        await server.start()
        self._server = server
        host = s.listen_address.rsplit(":", 1)[0]
        self.endpoint = Endpoint(
            address=f"{host}:{port}", port=port, ca_cert=ca_cert, insecure=s.insecure, tls_names=tls_names
        )
        core.record_address(self.endpoint.address)
        if s.metrics_address:
            self._metrics_server = self.telemetry.start_http_server(s.metrics_address)
        # Health follows the store: NOT_SERVING while the database is away, SERVING once it is back.
        store.database.availability.subscribe(self._store_availability_changed)
        if core.failure is None and store.database.availability.available:
            # (the loops may have given up already, on a store that fails at once)
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("coordinator listening", extra={"address": self.endpoint.address})

    def _loops_failed(self, exc: BaseException) -> None:
        """The background loops gave up: no job is driven any more. NOT_SERVING, then stop."""
        self.failure = exc
        if self._failing is None:
            self._failing = asyncio.get_running_loop().create_task(self._stop_on_failure(), name="fail-stop")

    def _store_availability_changed(self, available: bool) -> None:
        if self._server is None or self._stopping:
            return
        task = asyncio.get_running_loop().create_task(self._follow_store(), name="health-follows-store")
        self._health_updates.add(task)
        task.add_done_callback(self._health_updates.discard)

    async def _follow_store(self) -> None:
        if self._stopping or self.failure is not None or self.store is None:
            return
        # The store's state now, not the one this task was made for: updates that race end right.
        available = self.store.database.availability.available
        serving = (
            health_pb2.HealthCheckResponse.SERVING
            if available
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self._set_health(serving)

    async def _stop_on_failure(self) -> None:
        self._stopping = True
        if self._server is not None:
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.stop()

    @property
    def metrics_url(self) -> str | None:
        """The URL of the Prometheus endpoint, when one is served."""
        return self._metrics_server.url if self._metrics_server is not None else None

    async def _set_health(self, status: int) -> None:
        for name in ("", RUNNER_SERVICE.full_name, CONTROL_SERVICE.full_name):
            result = self._health.set(name, status)
            if asyncio.iscoroutine(result):
                await result

    async def wait_closed(self) -> None:
        """Waits until :meth:`stop` finished."""
        await self._closed.wait()

    async def stop(self, grace: float | None = None) -> None:
        """Stops gracefully: NOT_SERVING, no new tasks, in-flight calls finish within the grace period."""
        if self._closed.is_set():
            return
        grace_s = self.settings.shutdown_grace.total_seconds() if grace is None else grace
        self._stopping = True
        for update in list(self._health_updates):
            update.cancel()
        try:
            if self._server is not None:
                await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
                if self.device_protocol is not None:
                    self.device_protocol.stop_accepting()
                await self._server.stop(grace_s)
            if self._metrics_server is not None:
                self._metrics_server.stop()
            await self._stack.aclose()
        finally:
            self._closed.set()
