"""The in-process transport: a virtual device's Runner calls the coordinator's device protocol directly.

Nothing is serialized on the way down except what the real path serializes: a task's model is the
stored DXO bytes, decoded **once per model** (not once per device) and shared by every device of the
round. Sharing is safe because the arrays are read-only (an executor that writes to one gets
numpy's ``ValueError``, which fails its task loudly instead of corrupting its neighbours') and each
device gets its own ``DXO`` container (``data`` and ``meta`` dicts), so setting meta or replacing an
array touches only that device's copy. Results go up as the DXO object (``ResultInput.decoded``):
the protocol validates it as it is, and serializes it only if the coordinator stores its payload (the
run's driver folds results in-process when it can, and the simulation's throwaway store then keeps
their metadata only).

In-flight slots go to waiting devices lowest index first (:class:`OrderedSlots`): results then arrive
roughly in the order the workflow aggregates them (by device id), so its fold can take each at once
instead of holding many that wait for an earlier one.

Per-device state is a few fields, so ten thousand devices fit easily: the shared parts (the core, the
model cache, the counters) live in one :class:`DeviceHub`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import secrets
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from fedlink.common.dxo import DXO
from fedlink.common.errors import FailedPrecondition
from fedlink.common.status import DeviceStatus
from fedlink.common.version import PROTOCOL_VERSION
from fedlink.runner.loop import TaskWork, TaskWorker
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
from fedlink.server.core import CoordinatorCore
from fedlink.server.credentials import hash_credential
from fedlink.server.domain import Device, ResultStatus, new_id
from fedlink.server.protocol.device import ResultInput, TaskReply
from fedlink.server.protocol.possession import put_device_bytes
from fedlink.server.store.protocol import NewDevice
from fedlink.simulation.heterogeneity import DeviceRound, Heterogeneity

__all__ = ["DEFAULT_IN_FLIGHT", "DeviceHub", "InProcessTransport", "LiveCounts"]

#: Decoded models kept (the current round's and a few before it, for late devices).
_MODEL_CACHE = 4
#: Devices enrolled per store transaction.
_ENROL_BATCH = 2_000
#: How long a device keeps its in-flight slot after its report while the fold of its result does not
#: move (it waits for an earlier device's result): then it lets go, so that device can get a slot.
_FOLD_PATIENCE_S = 0.25
#: Results in flight when the hub is not told (the simulation sizes it from the model: see engine.py).
DEFAULT_IN_FLIGHT = 256


@dataclass(slots=True)
class LiveCounts:
    """What the virtual devices are doing right now (for the progress line)."""

    #: Devices holding a task (working on it, or waiting out their slowdown or link delay).
    busy: int = 0
    #: Results reported (succeeded) and failures reported, since the start.
    succeeded: int = 0
    failed: int = 0
    #: Tasks given back because the device dropped out of the round.
    dropped: int = 0
    #: ``(device index, round)`` of every drop-out, in the order they happened.
    drops: list[tuple[int, int]] = field(default_factory=list)
    #: ``(device index, round)`` of every device that took a task and went away for good.
    gone: list[tuple[int, int]] = field(default_factory=list)


class OrderedSlots:
    """A semaphore whose waiters are served lowest ``priority`` first (FIFO among equals)."""

    def __init__(self, value: int) -> None:
        self._free = value
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    async def acquire(self, priority: int) -> None:
        """Takes a slot, waiting behind every waiter of a lower priority value."""
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._seq), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # granted as it was cancelled: pass the slot on
            raise

    def release(self) -> None:
        """Gives a slot back, to the first waiter still waiting."""
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():
                future.set_result(None)
                return
        self._free += 1


class DeviceHub:
    """What all virtual devices of one simulation share: the core, the decoded models, the counters."""

    def __init__(
        self,
        core: CoordinatorCore,
        *,
        heterogeneity: Heterogeneity,
        seed: int,
        max_in_flight: int = DEFAULT_IN_FLIGHT,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
        self.core = core
        self.heterogeneity = heterogeneity
        self.seed = seed
        self.counts = LiveCounts()
        self.max_in_flight = max_in_flight
        #: Results in flight: a device holds a slot from the start of its task's work until the
        #: coordinator answered its report (see :class:`InProcessTransport`).
        self.slots = OrderedSlots(max_in_flight)
        self._models: OrderedDict[str, asyncio.Future[DXO]] = OrderedDict()

    async def model(self, sha256: str, inline: bytes | None) -> DXO:
        """The decoded task model ``sha256``: decoded (or read from the blob store) once, then shared."""
        future = self._models.get(sha256)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._models[sha256] = future
            while len(self._models) > _MODEL_CACHE:
                self._models.popitem(last=False)
            try:
                data = inline if inline is not None else await self.core.store.blobs.read(sha256)
                dxo = DXO.from_bytes(data)
                for array in dxo.data.values():
                    array.flags.writeable = False  # shared by every device: see the module docstring
                future.set_result(dxo)
            except BaseException as exc:
                self._models.pop(sha256, None)
                future.set_exception(exc)
                raise
        else:
            self._models.move_to_end(sha256)
        shared = await asyncio.shield(future)
        return DXO(kind=shared.kind, data=dict(shared.data), meta=dict(shared.meta))

    async def enroll(
        self,
        devices: Sequence[InProcessTransport],
        device_info: Mapping[str, str],
        *,
        width: int,
        job_name: str | None = None,
    ) -> list[str]:
        """Enrols ``devices`` as ``sim-<index>`` with fresh credentials, a batch per store transaction.

        ``job_name`` is the job their runners will ask for: recorded now, so that the first round
        samples every device rather than the first few whose GetJob came in.

        Returns:
            Their credentials, in order (a gRPC transport of the same device presents it).
        """
        # The ids are the simulation's (sim-000042), not the protocol's random ones, so that device
        # order, sampling and aggregation order are the same in every run with the same seed.
        # One read of the OS's entropy for all of them (a read per credential releases the GIL each time).
        entropy = secrets.token_bytes(32 * len(devices))
        credentials = [entropy[32 * i : 32 * (i + 1)].hex() for i in range(len(devices))]
        store = self.core.store
        for start in range(0, len(devices), _ENROL_BATCH):
            batch = devices[start : start + _ENROL_BATCH]
            # The enrolled rows are what authenticating the credentials would read back.
            enrolled = await store.enroll_devices(
                [
                    NewDevice(
                        device_id=f"sim-{device.index:0{width}d}",
                        credential_hash=hash_credential(credential),
                        device_info=device_info,
                        polled_job_name=job_name,
                    )
                    for device, credential in zip(batch, credentials[start:], strict=False)
                ]
            )
            for device, row in zip(batch, enrolled, strict=True):
                device._enrolled(row)
        return credentials

    def behaviour(self, device: int, round: int) -> DeviceRound:
        """How ``device`` behaves in ``round`` (see :class:`Heterogeneity`)."""
        return self.heterogeneity.draw(self.seed, device, round)


_STATUS = {
    DeviceStatus.OK: Status.OK,
    DeviceStatus.RETRY: Status.RETRY,
    DeviceStatus.NO_JOB: Status.NO_JOB,
    DeviceStatus.NO_TASK: Status.NO_TASK,
    DeviceStatus.DONE: Status.DONE,
    DeviceStatus.STALE: Status.STALE,
}


class InProcessTransport(Transport):
    """One virtual device's :class:`Transport`, calling ``hub.core.device_protocol`` in-process.

    The device is enrolled by :meth:`DeviceHub.enroll` (the simulation does it for all devices before
    the job is submitted, so the workflow samples among all of them); :meth:`open` then only checks
    that.
    """

    def __init__(self, hub: DeviceHub, index: int) -> None:
        self._hub = hub
        self._index = index
        self._device: Device | None = None
        self._round = 0
        self._started = 0.0
        self._busy = False
        self._holding = False

    @property
    def index(self) -> int:
        """The virtual device's index (its partition id)."""
        return self._index

    @property
    def device_id(self) -> str:
        """The device's id (after :meth:`DeviceHub.enroll`)."""
        return self._need_device().device_id

    def _need_device(self) -> Device:
        if self._device is None:
            raise FailedPrecondition(f"virtual device {self._index} is not enrolled")
        return self._device

    def _enrolled(self, device: Device) -> None:
        self._device = device
        self._hub.core.device_protocol.note_seen(device.device_id)

    async def open(self) -> None:
        """Checks the device is enrolled (there is no connection to open)."""
        self._need_device()

    async def close(self) -> None:
        """Gives back the busy count and the slot of a task that never got reported (stopped runner)."""
        self._set_busy(False)
        self._let_go()

    def gated(self, worker: TaskWorker) -> TaskWorker:
        """``worker``, run only while this device holds one of the hub's in-flight slots.

        The slot is taken before the task's work starts and given back once the coordinator answered
        the report (or the task was released), so at most ``hub.max_in_flight`` results exist at once
        however many devices finish together. A device that has to wait does so before its executor
        runs, holding nothing but its task.
        """
        return _GatedWorker(worker, self)

    async def _hold(self) -> None:
        if not self._holding:
            await self._hub.slots.acquire(self.index)
            self._holding = True

    def _let_go(self) -> None:
        if self._holding:
            self._holding = False
            self._hub.slots.release()

    def _set_busy(self, busy: bool) -> None:
        if busy != self._busy:
            self._busy = busy
            self._hub.counts.busy += 1 if busy else -1

    def _seen(self) -> Device:
        device = self._need_device()
        self._hub.core.device_protocol.note_seen(device.device_id)  # keeps it ONLINE, as a real call does
        return device

    async def _link(self) -> None:
        if self._round:
            delay = self._hub.behaviour(self._index, self._round).link_delay_s
            if delay > 0:
                await asyncio.sleep(delay)

    async def get_job(
        self, *, job_name: str, device_info: dict[str, str], user_info: dict[str, str]
    ) -> JobOffer:
        """GetJob, in-process."""
        reply = await self._hub.core.device_protocol.get_job(
            self._seen(), job_name=job_name, device_info=device_info, protocol_version=PROTOCOL_VERSION
        )
        job = reply.job
        return JobOffer(
            status=_STATUS[reply.status],
            job_id=job.job_id if job else "",
            job_name=job.name if job else "",
            job_data=job.job_data if job else "",
            retry_after=reply.retry_after,
            message=reply.message,
        )

    async def get_task(self, *, job_id: str, cookie: bytes) -> TaskOffer:
        """GetTask (a long poll), in-process; a device that drops out of the round gives the task back."""
        protocol = self._hub.core.device_protocol
        while True:
            reply = await protocol.get_task(self._seen(), job_id=job_id, cookie=cookie, wait=None)
            if reply.status is not DeviceStatus.OK or reply.task is None:
                return _offer(reply, None)
            self._round = reply.task.round
            if self._hub.behaviour(self._index, self._round).dropped:
                await protocol.release(
                    self._seen(), job_id=job_id, task_id=reply.task.task_id, cookie=reply.cookie
                )
                self._hub.counts.dropped += 1
                self._hub.counts.drops.append((self._index, self._round))
                cookie = b""
                continue
            payload = reply.payload
            if self._hub.behaviour(self._index, self._round).vanished:
                # Gone with the task: no report, no renewal, no more calls (its lease runs out). The
                # wait ends when the run stops its runner.
                self._hub.counts.gone.append((self._index, self._round))
                await asyncio.Event().wait()
            data = None if payload is None else await self._hub.model(payload.sha256, payload.inline)
            await self._link()
            self._set_busy(True)
            self._started = asyncio.get_running_loop().time()  # a scaled loop's time (see clock.py)
            return _offer(reply, data)

    async def report_result(self, report: ResultReport) -> Ack:
        """ReportResult, in-process: the result DXO goes as it is (see ``ResultInput.decoded``).

        The device keeps its in-flight slot from its work to the coordinator's answer, except while
        it waits out its simulated slowdown or link delay (a slow device must not hold up others).
        """
        behaviour = self._hub.behaviour(self._index, self._round) if self._round else None
        delay = 0.0
        if behaviour is not None:
            took = asyncio.get_running_loop().time() - self._started
            if behaviour.compute_s is not None:  # the drawn compute time, less what the work took
                delay = max(0.0, behaviour.compute_s - took)
            elif behaviour.slowdown > 1.0:
                delay = (behaviour.slowdown - 1.0) * took
            delay += behaviour.link_delay_s
        try:
            if delay > 0:
                self._let_go()
                await asyncio.sleep(delay)
            await self._hold()
            result = report.result
            request = ResultInput(
                job_id=report.job_id,
                task_id=report.task_id,
                cookie=report.cookie,
                status=ResultStatus.SUCCEEDED if result is not None else ResultStatus.FAILED,
                error_message=report.error_message,
                request_id=report.request_id or new_id(),
                # Validated as it is, and serialized only if the coordinator stores it: the run's
                # driver folds it in-process when it can (then the throwaway store keeps its metadata).
                decoded=result,
            )
            reply = await self._hub.core.device_protocol.report_result(self._seen(), request)
            sink = self._hub.core.supervisor.sink(report.job_id) if result is not None else None
            if sink is not None and reply.status is DeviceStatus.OK:
                # The slot is kept until the run's driver used this result (or its sink stalls):
                # results are made no faster than they are used, so none has to be stored instead.
                await sink.absorbed(report.task_id, patience=_FOLD_PATIENCE_S)
        finally:
            self._set_busy(False)
            self._let_go()
        if result is not None:
            self._hub.counts.succeeded += 1
        else:
            self._hub.counts.failed += 1
        return Ack(status=_STATUS[reply.status], cookie=reply.cookie, message=reply.message)

    async def renew_lease(self, *, job_id: str, task_id: str, cookie: bytes) -> LeaseAck:
        """RenewLease, in-process."""
        reply = await self._hub.core.device_protocol.renew_lease(
            self._seen(), job_id=job_id, task_id=task_id, cookie=cookie
        )
        return LeaseAck(status=_STATUS[reply.status], lease_expires_at=reply.lease_expires_at)

    async def release(self, *, job_id: str, task_id: str, cookie: bytes, reason: str) -> LeaseAck:
        """ReleaseAssignment, in-process."""
        try:
            reply = await self._hub.core.device_protocol.release(
                self._seen(), job_id=job_id, task_id=task_id, cookie=cookie
            )
        finally:
            self._set_busy(False)
            self._let_go()
        return LeaseAck(status=_STATUS[reply.status], lease_expires_at=reply.lease_expires_at)

    async def download_blob(self, sha256: str, size_bytes: int) -> bytes:
        """Reads a blob from the store."""
        return await self._hub.core.store.blobs.read(sha256)

    async def upload_blob(self, data: bytes) -> str:
        """Stores bytes as a blob the device holds (it may report it), as an upload over gRPC does."""
        return (await put_device_bytes(self._hub.core.store, self._need_device().device_id, data)).sha256


class _GatedWorker:
    """A device's :class:`TaskWorker`: takes the device's in-flight slot, then runs the real worker."""

    def __init__(self, worker: TaskWorker, device: InProcessTransport) -> None:
        self._worker = worker
        self._device = device

    async def run(self, work: TaskWork) -> DXO:
        """Waits for an in-flight slot (kept until the report is answered), then runs ``work``."""
        await self._device._hold()
        return await self._worker.run(work)


def _offer(reply: TaskReply, data: DXO | None) -> TaskOffer:
    task, assignment = reply.task, reply.assignment
    retry: timedelta | None = reply.retry_after
    version = task.model_version if task else None
    return TaskOffer(
        status=_STATUS[reply.status],
        task_id=task.task_id if task else "",
        task_name=task.name if task else "",
        task_data=with_model_version(data, version),
        cookie=reply.cookie,
        deadline=task.deadline if task else None,
        lease_expires_at=assignment.lease_expires_at if assignment else None,
        retry_after=retry,
        assignment_id=assignment.assignment_id if assignment else "",
        round=task.round if task else 0,
        model_version=version,
    )
