"""The coordinator without its network front: store, protocols, job supervisor and upkeep loops.

:class:`~fedlink.server.app.Coordinator` puts gRPC in front of it; the simulation drives the same core
in-process, so both run exactly the same workflow, store and protocol code.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import os
import secrets
import socket
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import TracebackType

from fedlink.common.dxo import DXO
from fedlink.server.coordination.known_tasks import KnownTasks
from fedlink.server.coordination.notify import LocalTaskNotifier, TaskNotifier
from fedlink.server.coordination.pg_notify import PgTaskNotifier
from fedlink.server.data_dir import DataDirLock
from fedlink.server.domain import Clock, SystemClock, Task
from fedlink.server.protocol.control import ControlProtocol
from fedlink.server.protocol.cookies import CookieSigner
from fedlink.server.protocol.device import DeviceProtocol, DeviceProtocolConfig, ResultListener
from fedlink.server.protocol.enrolment import EnrolmentPolicy
from fedlink.server.protocol.events import JobEvents
from fedlink.server.protocol.results import ModelTaskValidator
from fedlink.server.services.collection import Collection, CollectionPolicy
from fedlink.server.services.loops import BackgroundLoops, LoopPolicy
from fedlink.server.services.maintenance import Maintenance
from fedlink.server.services.metrics import MetricsCollector
from fedlink.server.services.store_probe import StoreProbe
from fedlink.server.services.supervisor import JobSupervisor
from fedlink.server.services.tracking import JobTracker
from fedlink.server.settings import CoordinatorSettings
from fedlink.server.store.dialect import sqlite_file
from fedlink.server.store.outages import StoreRetryPolicy, is_store_away
from fedlink.server.store.sql import SqlStateStore, create_store
from fedlink.server.telemetry import Telemetry
from fedlink.server.tracking import TrackingConfig, build_sinks
from fedlink.server.workflows.registry import DriverOptions, WorkflowLimits, Workflows

log = logging.getLogger(__name__)

#: Largest model (initial or uploaded blob) the coordinator accepts.
MAX_MODEL_BYTES = 2 * 1024**3


class _PokeSupervisor(ResultListener):
    def __init__(self, supervisor: JobSupervisor, events: JobEvents) -> None:
        self._supervisor = supervisor
        self._events = events

    def result_recorded(self, job_id: str, task: Task) -> None:
        self._supervisor.progress(job_id, task_id=task.task_id)
        self._events.wake(job_id)  # the result's result_received event is stored: watchers see it now

    def offer(self, job_id: str, task: Task, request_id: str, update: DXO) -> bool:
        sink = self._supervisor.sink(job_id)
        return sink is not None and sink.offer(task.task_id, request_id, update)

    def settle(self, job_id: str, task: Task, request_id: str, *, accepted: bool) -> None:
        sink = self._supervisor.sink(job_id)
        if sink is not None:
            sink.settle(task.task_id, request_id, accepted=accepted)


def coordinator_id(data_dir: Path) -> str:
    """This coordinator's stable identity, kept in its data directory.

    Which coordinator drives a run is a lease held under this id; a coordinator restarted on the same
    data directory is the same owner and resumes its runs at once instead of waiting for its own
    lease to expire.
    """
    path = data_dir / "coordinator-id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    identity = f"{socket.gethostname()}-{secrets.token_hex(4)}"
    partial = path.with_name(f".coordinator-id.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(identity + "\n")
    try:
        os.link(partial, path)  # first writer wins; a concurrent start reads the winner's id
    except FileExistsError:
        pass
    finally:
        partial.unlink(missing_ok=True)
    return path.read_text().strip()


def collection_policy(settings: CoordinatorSettings) -> CollectionPolicy:
    """What the scheduled collection deletes, and when, as the settings say."""
    return CollectionPolicy(
        interval=settings.collection_interval,
        unused_blob_ttl=settings.unused_blob_ttl,
        stale_upload_ttl=settings.stale_upload_ttl,
        finished_job_events_ttl=settings.finished_job_events_ttl,
        max_finished_job_events=settings.max_finished_job_events,
    )


class CoordinatorCore:
    """Everything of the coordinator but the network: ``async with CoordinatorCore(settings) as core``."""

    def __init__(
        self,
        settings: CoordinatorSettings,
        *,
        clock: Clock | None = None,
        join_secret: str | None = None,
        supervisor_poll_seconds: float = 1.0,
        round_check_seconds: float | None = None,
        on_result_outcome: Callable[[str], None] | None = None,
        keep_folded_payloads: bool = True,
        telemetry: Telemetry | None = None,
    ) -> None:
        self.settings = settings
        self.clock: Clock = clock or SystemClock()
        self._join_secret = join_secret
        self._poll = supervisor_poll_seconds
        self._round_check = round_check_seconds
        self._on_result_outcome = on_result_outcome
        self._keep_folded_payloads = keep_folded_payloads
        self._tasks: list[asyncio.Task[None]] = []
        self._store: SqlStateStore | None = None
        self._device: DeviceProtocol | None = None
        self._control: ControlProtocol | None = None
        #: The tasks this coordinator's workflows created, shared with its device protocol.
        self.known_tasks = KnownTasks()
        #: Called with a device id when an operator revokes it (e.g. to evict credential caches).
        self.on_device_revoked: list[Callable[[str], None]] = []
        #: Called with the error when the background loops stop on a failure (the coordinator then
        #: drives no job: its owner should stop it).
        self.on_failure: list[Callable[[BaseException], None]] = []
        #: Why the background loops stopped, if they did.
        self.failure: BaseException | None = None
        self._failed = asyncio.Event()
        self._telemetry = telemetry
        self._lock: DataDirLock | None = None
        self._pg_notifier: PgTaskNotifier | None = None

    @property
    def store(self) -> SqlStateStore:
        """The state store (after :meth:`start`)."""
        assert self._store is not None, "CoordinatorCore.start() first"
        return self._store

    @property
    def device_protocol(self) -> DeviceProtocol:
        """The device protocol (after :meth:`start`)."""
        assert self._device is not None, "CoordinatorCore.start() first"
        return self._device

    @property
    def control_protocol(self) -> ControlProtocol:
        """The control protocol (after :meth:`start`)."""
        assert self._control is not None, "CoordinatorCore.start() first"
        return self._control

    async def __aenter__(self) -> CoordinatorCore:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Opens the store and starts the job supervisor and the upkeep loops."""
        s = self.settings
        s.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Before the store opens: a second process on this directory must not touch it at all.
        self._lock = DataDirLock.acquire(
            s.data_dir, address=s.listen_address, sqlite_file=sqlite_file(s.db_url)
        )
        store = await create_store(
            s.db_url,
            blob_dir=s.blob_dir,
            blobs_in_database=s.blobs_in_database,
            clock=self.clock,
            auto_migrate=s.auto_migrate,
            retry=StoreRetryPolicy(budget=s.store_retry_budget),
        )
        self._store = store
        key = await store.get_or_create_signing_key()
        owner = coordinator_id(s.data_dir)
        notifier = await self._start_notifier(store, owner)
        events = JobEvents(store)
        workflows = Workflows(
            WorkflowLimits(
                allow_workflows=s.allow_workflows,
                max_buffered_round_bytes=s.max_buffered_round_bytes,
                defaults={"keep_checkpoints": s.keep_checkpoints},
            ),
            DriverOptions(poll_seconds=self._poll, round_check_seconds=self._round_check),
        )
        supervisor = JobSupervisor(
            store,
            clock=self.clock,
            notifier=notifier,
            events=events,
            owner=owner,
            workflows=workflows,
            run_lease=s.run_lease,
            known_tasks=self.known_tasks,
        )
        self.supervisor = supervisor
        if self._pg_notifier is not None:
            # Reports recorded here for a run another replica drives reach its driver, and theirs ours.
            supervisor.relay = self._pg_notifier.relay_progress
            self._pg_notifier.on_progress = supervisor.heard
        self._device = DeviceProtocol(
            store,
            signer=CookieSigner(key),
            enrolment_key=hmac.new(key, b"fedlink enrolment", hashlib.sha256).digest(),
            notifier=notifier,
            validator=ModelTaskValidator(store.blobs),
            clock=self.clock,
            config=DeviceProtocolConfig(
                lease=s.lease,
                max_task_wait=s.max_task_wait,
                default_task_wait=s.default_task_wait,
                inline_payload_bytes=s.inline_payload_bytes,
                max_result_bytes=MAX_MODEL_BYTES,
                job_retry_after=s.job_retry_after,
                enrolment=EnrolmentPolicy(
                    join_secret=self._join_secret,
                    require_approval=s.require_approval,
                    max_devices=s.max_devices,
                    per_minute=s.enrolments_per_minute,
                    burst=s.enrolment_burst,
                    replay_window=s.enrolment_replay_window,
                ),
                keep_folded_payloads=self._keep_folded_payloads,
            ),
            listener=_PokeSupervisor(supervisor, events),
            on_outcome=self._on_result_outcome,
            known_tasks=self.known_tasks,
        )
        self._control = ControlProtocol(
            store,
            events=events,
            notifier=notifier,
            on_job_change=supervisor.poke,
            on_device_revoked=self._device_revoked,
            max_model_bytes=MAX_MODEL_BYTES,
            component_types=s.component_types,
            workflows=workflows,
        )
        maintenance = Maintenance(
            store,
            clock=self.clock,
            notifier=notifier,
            drain_seen=self._device.drain_seen,
            on_run_progress=functools.partial(supervisor.progress, urgent=True),
            interval=s.reaper_interval,
            offline_after=s.online_window,
        )
        # An unreachable database is waited out, not given up on (health says NOT_SERVING meanwhile).
        loops = BackgroundLoops(LoopPolicy(give_up_after=s.loop_failure_timeout, ride_out=is_store_away))
        loops.add(supervisor.loop())
        loops.add(maintenance.loop())
        loops.add(Collection(store, clock=self.clock, policy=collection_policy(s)).loop())
        # A corrupted blob a device's read found fails the jobs using it (a workflow's read fails its own).
        store.blobs.integrity.listeners.append(supervisor.fail_jobs_using)
        loops.add(StoreProbe(store.database).loop())
        if self._telemetry is not None:
            loops.add(MetricsCollector(store, self._telemetry, interval=timedelta(seconds=5)).loop())
        tracking = TrackingConfig(
            mlflow_tracking_uri=s.mlflow_tracking_uri,
            mlflow_experiment=s.mlflow_experiment,
            tensorboard_dir=s.tensorboard_dir,
        )
        if tracking.enabled:
            # Built before any job runs: a sink whose library is missing stops the start, not a job.
            tracker = JobTracker(await asyncio.to_thread(build_sinks, tracking))
            events.listeners.append(tracker.heard)
            loops.add(tracker.loop())
        self.loops = loops
        self._tasks = [asyncio.create_task(self._run_loops(loops), name="background-loops")]

    async def _start_notifier(self, store: SqlStateStore, owner: str) -> TaskNotifier:
        """The long polls' wake-ups: in-process on SQLite; on PostgreSQL also across the replicas
        sharing the database (LISTEN/NOTIFY)."""
        if store.database.is_sqlite:
            return LocalTaskNotifier()
        self._pg_notifier = PgTaskNotifier(store.database.url, replica=owner)
        await self._pg_notifier.start()
        return self._pg_notifier

    async def _run_loops(self, loops: BackgroundLoops) -> None:
        """Runs the loops; if one gives up, records why and tells :attr:`on_failure`'s callbacks."""
        try:
            await loops.run()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.critical("the coordinator's background loops stopped: %s", exc, exc_info=exc)
            self.failure = exc
            self._failed.set()
            for callback in self.on_failure:
                callback(exc)

    async def wait_failed(self) -> BaseException:
        """Returns (the error) once the background loops stopped on a failure; never otherwise."""
        await self._failed.wait()
        assert self.failure is not None
        return self.failure

    def _device_revoked(self, device_id: str) -> None:
        for listener in self.on_device_revoked:
            listener(device_id)

    def stop_accepting(self) -> None:
        """Stops handing out tasks (the first step of a graceful shutdown)."""
        if self._device is not None:
            self._device.stop_accepting()

    async def stop(self) -> None:
        """Stops the background services and closes the store; safe to call twice."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._device is not None:
            self._device.close()
        pg_notifier, self._pg_notifier = self._pg_notifier, None
        if pg_notifier is not None:
            await pg_notifier.close()
        store, self._store = self._store, None
        if store is not None:
            await store.close()
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def record_address(self, address: str) -> None:
        """Records where this coordinator listens in its data directory's lock (for a second one's
        refusal message)."""
        if self._lock is not None:
            self._lock.record(address)
