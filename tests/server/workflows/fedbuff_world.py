"""A FedBuff run against a real store, with the tests playing its devices through the store's API.

The workflow runs as the coordinator runs it (a task driving a :class:`WorkflowContext`); the devices
claim, report, fail, release and let leases expire with the same store calls the device protocol makes,
and poke the run's progress as the report path does. ``via_sink`` hands an update over in-process first
(offer, record, settle), as the device protocol does for a run its coordinator drives. Time is a manual
clock: pickup and task deadlines, leases and the device wait move only when a test advances it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np

from fedlink.common.dxo import DXO, DataKind, MetaKey, weight_of
from fedlink.server.coordination.notify import LocalTaskNotifier
from fedlink.server.coordination.progress import Progress
from fedlink.server.domain import (
    Assignment,
    AssignmentState,
    ManualClock,
    ResultStatus,
    Task,
    TaskState,
    WorkflowSpec,
)
from fedlink.server.protocol.events import JobEvents
from fedlink.server.store import NewJob, RecordOutcome, ResultReport, SqlStateStore
from fedlink.server.workflows.base import WorkflowContext
from fedlink.server.workflows.fedbuff import FedBuff, FedBuffParams

T0 = datetime(2026, 1, 1, tzinfo=UTC)
LEASE = timedelta(seconds=60)
MODEL = {"w": np.linspace(-1, 1, 300, dtype=np.float32).reshape(10, 30), "b": np.zeros(4, np.float32)}


def update_of(index: int, version: int, *, kind: DataKind = DataKind.WEIGHT_DIFF) -> DXO:
    """Device ``index``'s update of model ``version``: distinct values and weight per device and version."""
    rng = np.random.default_rng([index, version])
    diff = {k: (rng.standard_normal(v.shape) * 0.01).astype(np.float32) for k, v in MODEL.items()}
    meta: dict[str, Any] = {MetaKey.NUM_EXAMPLES: 1 + 3 * index, "loss": 1.0 + index}
    return DXO(kind=kind, data=diff, meta=meta)


@dataclass
class FedBuffWorld:
    """A job whose run a FedBuff driver drives, and its enrolled devices."""

    store: SqlStateStore
    clock: ManualClock
    params: FedBuffParams
    job_id: str
    run_id: str
    devices: list[str]
    progress: Progress = field(default_factory=Progress)
    driver: asyncio.Task[None] | None = None
    #: What each device reported, by task: (task, update) in the order reported (accepted or not).
    reported: list[tuple[Task, DXO, str]] = field(default_factory=list)
    #: The assignment each device works on (claimed, not reported yet).
    holding: dict[str, Assignment] = field(default_factory=dict)

    @classmethod
    async def open(
        cls, store: SqlStateStore, clock: ManualClock, params: FedBuffParams, *, devices: int
    ) -> FedBuffWorld:
        enrolled = [
            (await store.enroll_device({"n": str(i)}, {}, f"cred-{i}", device_id=f"device-{i:03d}")).device_id
            for i in range(devices)
        ]
        # Devices that asked for work of any job (GetJob), as runners do: those are sampled.
        await store.record_polls([(d, "") for d in enrolled], clock.now())
        sha = (await store.blobs.put_bytes(DXO(kind=DataKind.WEIGHTS, data=MODEL).to_bytes())).sha256
        spec = WorkflowSpec(name="fedbuff", config=params.to_config())
        job = await store.create_job(
            NewJob(name="buffered", spec_json=spec.to_json(), job_data="{}", initial_model_sha256=sha)
        )
        lease = timedelta(minutes=5)
        run = await store.acquire_job_run(job.job_id, owner="test", now=clock.now(), lease=lease)
        return cls(
            store=store, clock=clock, params=params, job_id=job.job_id, run_id=run.run_id, devices=enrolled
        )

    def index(self, device: str) -> int:
        return self.devices.index(device)

    async def context(self) -> WorkflowContext:
        """A context as the supervisor makes one: the job and the run as the store has them now."""
        return WorkflowContext(
            store=self.store,
            clock=self.clock,
            notifier=LocalTaskNotifier(),
            progress=self.progress,
            events=JobEvents(self.store),
            job=await self.store.get_job(self.job_id),
            run=await self.store.get_run(self.run_id),
        )

    async def start(self) -> asyncio.Task[None]:
        """Starts (or, after :meth:`stop`, resumes) the driver, as a restarted coordinator would."""
        workflow = FedBuff(self.params, poll_seconds=0.02, min_check_seconds=0.0)
        self.progress = Progress()
        ctx = await self.context()
        self.driver = asyncio.create_task(workflow.run(ctx))
        return self.driver

    async def stop(self) -> None:
        """Cancels the driver at whatever await it is (a killed coordinator's driver stops as abruptly)."""
        assert self.driver is not None
        self.driver.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.driver

    # ---- what the store shows ----
    async def out(self, name: str | None = None) -> dict[str, Task]:
        """The tasks out (open, not reported), by the device each is for: the selection (with ``name``,
        only tasks of that name: ``train`` or ``evaluate``)."""
        tasks = [
            t
            for t in await self.store.list_tasks(self.run_id)
            if t.state is TaskState.OPEN and name in (None, t.name)
        ]
        ids = [t.task_id for t in tasks]
        done = {
            a.task_id
            for a in await self.store.list_assignments(task_ids=ids)
            if a.state in (AssignmentState.COMPLETED, AssignmentState.FAILED)
        }
        targets = await self.store.task_targets(task_ids=ids)
        return {targets[t.task_id][0]: t for t in tasks if t.task_id not in done}

    async def version(self) -> int:
        return (await self.store.get_run(self.run_id)).round

    async def events(self, kind: str = "model_version") -> list[dict[str, Any]]:
        return [
            json.loads(e.payload_json)
            for e in await self.store.list_job_events(self.job_id)
            if e.kind == kind
        ]

    async def until(self, check: Callable[[], Awaitable[bool]], *, what: str, within: float = 5.0) -> None:
        """Waits until ``check()`` holds (the driver reacts in the background); fails naming ``what``."""
        loop = asyncio.get_running_loop()
        ends = loop.time() + within
        while not await check():
            if self.driver is not None and self.driver.done():
                self.driver.result()  # raises the workflow's error
            if loop.time() > ends:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.01)

    async def settled(self, count: int) -> dict[str, Task]:
        """Waits until ``count`` tasks are out; returns them by device."""

        async def check() -> bool:
            return len(await self.out()) == count

        await self.until(check, what=f"{count} tasks out")
        return await self.out()

    # ---- what devices do ----
    async def claim(self, device: str) -> Assignment:
        """``device`` claims a task; it works on it (and reports for it) until it reports."""
        held = self.holding.get(device)
        if held is not None:
            return held
        assignment = await self.store.claim_task(device, self.job_id, self.clock.now(), LEASE)
        assert assignment is not None, f"{device} has no task to claim"
        self.holding[device] = assignment
        return assignment

    async def report(
        self,
        device: str,
        *,
        fail: bool = False,
        via_sink: bool = False,
        kind: DataKind = DataKind.WEIGHT_DIFF,
    ) -> RecordOutcome:
        """``device`` claims its task (if it has not) and reports its update, or a failure."""
        assignment = await self.claim(device)
        del self.holding[device]
        task = await self.store.get_task(assignment.task_id)
        version = task.model_version or 0
        update = update_of(self.index(device), version, kind=kind)
        if kind is DataKind.WEIGHTS:
            base = DXO.from_bytes(await self.store.blobs.read(task.payload_sha256 or ""))
            update = DXO(
                kind=kind, data={k: base.data[k] + v for k, v in update.data.items()}, meta=update.meta
            )
        request_id = f"{device}-{task.task_id}"
        held = False
        sink = self.progress.sink
        if via_sink and not fail and sink is not None:
            held = sink.offer(task.task_id, request_id, update)
        sha = None
        if not fail:
            sha = (await self.store.blobs.put_bytes(update.to_bytes())).sha256
        outcome = await self.store.record_result(
            ResultReport(
                assignment_id=assignment.assignment_id,
                device_id=device,
                status=ResultStatus.FAILED if fail else ResultStatus.SUCCEEDED,
                payload_sha256=sha,
                report_digest=hashlib.sha256(request_id.encode()).hexdigest(),
                request_id=request_id,
                error_message="boom" if fail else "",
            ),
            self.clock.now(),
        )
        if held and sink is not None:
            sink.settle(task.task_id, request_id, accepted=outcome.result.accepted and not outcome.duplicate)
        self.progress.poke()
        self.reported.append((task, update, outcome.outcome.value))
        return outcome

    async def release(self, device: str) -> None:
        assignment = await self.claim(device)
        del self.holding[device]
        await self.store.release_assignment(assignment.assignment_id, device, self.clock.now())
        self.progress.poke()

    async def expire(self, device: str) -> None:
        """``device`` claims its task and goes silent until its lease runs out (the reaper expires it)."""
        await self.claim(device)
        del self.holding[device]
        self.clock.advance(LEASE + timedelta(seconds=1))
        expired = await self.store.expire_leases(self.clock.now())
        assert expired
        self.progress.poke(urgent=True)


def expected_model(
    consumed: list[list[tuple[int, int, int]]], *, lr: float = 1.0, stale: bool = False
) -> Mapping[str, np.ndarray]:
    """The model FedBuff makes from ``consumed[i]``: the (device index, trained-on version, current
    version) of the updates of version i + 1, computed here in float64 from the rule."""
    model = {k: v.copy() for k, v in MODEL.items()}
    for updates in consumed:
        new = {}
        for name, value in model.items():
            total = np.zeros(value.shape, np.float64)
            weight = 0.0
            for index, version, current in updates:
                s = 1.0 / (1.0 + np.sqrt(current - version)) if stale else 1.0
                a = weight_of(update_of(index, version))
                total += s * a * update_of(index, version).data[name].astype(np.float64)
                weight += s * a
            new[name] = (value.astype(np.float64) + lr * total / weight).astype(value.dtype)
        model = new
    return model
