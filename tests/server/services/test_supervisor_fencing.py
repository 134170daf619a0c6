"""Two coordinators' job supervisors on one database: a driver paused past its run's lease, whose run
another supervisor took over meanwhile, is stopped by the fence when it wakes up, without failing the
job; the new driver finishes the run, each checkpoint written once. Real stores (a SQLite file, and
PostgreSQL), real supervisors and drivers; the workflow is an import-path one whose driver the test
holds at a gate (the "pause"), and time is a manual clock per coordinator.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedlink.common.dxo import DXO, DataKind
from fedlink.server.coordination.notify import LocalTaskNotifier
from fedlink.server.domain import Clock, JobState, ManualClock, RunState, SystemClock, WorkflowSpec
from fedlink.server.protocol.events import JobEvents
from fedlink.server.services.loops import LoopPolicy
from fedlink.server.services.supervisor import JobSupervisor
from fedlink.server.store import NewJob, SqlStateStore, create_store
from fedlink.server.workflows.base import WorkflowContext
from fedlink.server.workflows.registry import WorkflowLimits, Workflows

#: The module name the coordinators import the gated workflow from (this module, registered under it).
MODULE = "fedlink_fencing_probe"
T0 = datetime(2030, 1, 1, tzinfo=UTC)
LONG_LEASE = timedelta(seconds=30)  # its renewer sleeps 10 s: it does not renew during a test
WAIT_S = 30.0


@dataclass
class Gate:
    """Where a coordinator's driver waits after the first checkpoint: the test's "pause"."""

    reached: asyncio.Event
    opened: asyncio.Event


GATES: dict[str, Gate] = {}


def model(round_no: int, owner: str) -> DXO:
    return DXO(kind=DataKind.WEIGHTS, data={"w": np.full(4, round_no, np.float32)}, meta={"by": owner})


class GatedWorkflow:
    """Checkpoints round 1, waits at its coordinator's gate, starts and checkpoints round 2, and is done."""

    async def run(self, ctx: WorkflowContext) -> None:
        owner = ctx.run.owner or ""
        if ctx.completed < 1:
            await ctx.checkpoint(1, model(1, owner))
        gate = GATES[owner]
        gate.reached.set()
        await gate.opened.wait()
        await ctx.emit("round_started", 2, {"num_devices": 0})
        await ctx.checkpoint(2, model(2, owner))


def gated(config: Mapping[str, Any]) -> GatedWorkflow:
    """The import-path factory."""
    return GatedWorkflow()


@pytest.fixture(params=["sqlite-file", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite-file":
        return f"sqlite+aiosqlite:///{tmp_path / 'fedlink.db'}"
    url: str = request.getfixturevalue("pg_database")
    return url


@pytest.fixture(autouse=True)
def probe_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, MODULE, sys.modules[__name__])
    GATES.clear()


@dataclass
class Replica:
    """One coordinator's store and job supervisor."""

    owner: str
    store: SqlStateStore
    supervisor: JobSupervisor
    gate: Gate


@asynccontextmanager
async def replica(
    url: str, owner: str, clock: Clock, run_lease: timedelta, scan_seconds: float = 2.0
) -> AsyncIterator[Replica]:
    store = await create_store(url, clock=clock, blobs_in_database=True, auto_migrate=True, pool_size=2)
    gate = GATES[owner] = Gate(asyncio.Event(), asyncio.Event())
    supervisor = JobSupervisor(
        store,
        clock=clock,
        notifier=LocalTaskNotifier(),
        events=JobEvents(store),
        owner=owner,
        workflows=Workflows(WorkflowLimits(allow_workflows=(MODULE,))),
        run_lease=run_lease,
        scan_seconds=scan_seconds,
    )
    try:
        yield Replica(owner, store, supervisor, gate)
    finally:
        await supervisor.close()
        await store.close()


async def submit(store: SqlStateStore) -> str:
    spec = WorkflowSpec(name=f"{MODULE}:gated")
    job = await store.create_job(NewJob(name="fenced", spec_json=spec.to_json(), job_data="{}"))
    return job.job_id


async def logged(caplog: pytest.LogCaptureFixture, text: str) -> str:
    async with asyncio.timeout(WAIT_S):
        while True:
            found = [r.getMessage() for r in caplog.records if text in r.getMessage()]
            if found:
                return found[0]
            await asyncio.sleep(0.01)


async def job_state(store: SqlStateStore, job_id: str, state: JobState) -> None:
    async with asyncio.timeout(WAIT_S):
        while True:
            if (await store.get_job(job_id)).state is state:
                return
            await asyncio.sleep(0.01)


async def take_up(b: Replica) -> None:
    """B's supervisor scans, as its loop would, until its driver has the run (at B's gate)."""
    async with asyncio.timeout(WAIT_S):
        while True:
            await (
                b.supervisor.scan()
            )  # the first scan after a refused try drops that driver, the next starts one
            if b.gate.reached.is_set():
                return
            await asyncio.sleep(0.05)


async def finish_on_b(b: Replica, job_id: str) -> None:
    """B's driver (at its gate after resuming from round 1) goes on; the job ends FINISHED with B's model."""
    b.gate.opened.set()
    await job_state(b.store, job_id, JobState.FINISHED)
    # The run ends in the write after the job's (a final job is not scanned, so nobody takes it up).
    async with asyncio.timeout(WAIT_S):
        while True:
            run = await b.store.get_current_run(job_id)
            if run.state is not RunState.RUNNING:
                break
            await asyncio.sleep(0.01)
    assert (run.state, run.round, run.owner) == (RunState.FINISHED, 2, None)
    kept = await b.store.list_checkpoints(run.run_id)
    assert [c.round for c in kept] == [1, 2]
    final = DXO.from_bytes(await b.store.blobs.read(kept[-1].model_sha256))
    assert final.meta["by"] == b.owner and float(final.data["w"][0]) == 2.0
    events = await b.store.list_job_events(job_id)
    assert sum('"FAILED"' in e.payload_json for e in events) == 0, events
    assert [e.kind for e in events].count("round_started") == 1, events  # B's only


async def test_a_paused_driver_that_wakes_after_a_take_over_is_refused_its_checkpoint(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock(T0)
    caplog.set_level(logging.WARNING, logger="fedlink.server.services.supervisor")
    async with (
        replica(db_url, "coordinator-a", clock, LONG_LEASE) as a,
        replica(db_url, "coordinator-b", clock, LONG_LEASE) as b,
    ):
        job_id = await submit(a.store)
        await a.supervisor.scan()
        await asyncio.wait_for(a.gate.reached.wait(), WAIT_S)  # A checkpointed round 1 and "froze"
        await b.supervisor.scan()
        await asyncio.sleep(0.2)
        assert not b.gate.reached.is_set()  # A's lease holds: B is a plain replica

        clock.advance(LONG_LEASE + timedelta(seconds=1))  # A's lease lapses while it is paused
        await take_up(b)  # B takes the run and resumes it at round 1
        taken = await b.store.get_current_run(job_id)
        assert (taken.owner, taken.lease_epoch, taken.round) == ("coordinator-b", 2, 1)

        a.gate.opened.set()  # A wakes up and tries to checkpoint round 2
        message = await logged(caplog, "stopped driving job")
        assert "coordinator 'coordinator-b' took it over (lease epoch 2)" in message, message
        run = await a.store.get_current_run(job_id)
        assert (run.state, run.owner, run.round) == (RunState.RUNNING, "coordinator-b", 1)
        assert [c.round for c in await a.store.list_checkpoints(run.run_id)] == [1]
        assert (await a.store.get_job(job_id)).state is JobState.RUNNING  # not failed
        # Its event was the write refused: round 2 has not started, as far as the job's watchers know.
        assert [e.kind for e in await a.store.list_job_events(job_id)] == ["job_state_changed"]

        # A goes on as a plain replica: its next scan tries the lease and leaves the run to B.
        await a.supervisor.scan()
        await asyncio.sleep(0.2)
        assert (await a.store.get_current_run(job_id)).owner == "coordinator-b"
        await finish_on_b(b, job_id)


async def test_a_paused_drivers_renewer_finds_the_lease_lost_and_stops_its_driver(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A's clock stands still (its renewals never reach past T0 + 0.3 s), B's is a minute ahead: A's
    # renewer keeps running, yet B takes the run over, and A's next renewal is refused.
    caplog.set_level(logging.WARNING, logger="fedlink.server.services.supervisor")
    async with (
        replica(db_url, "coordinator-a", ManualClock(T0), timedelta(seconds=0.3)) as a,
        replica(db_url, "coordinator-b", ManualClock(T0 + timedelta(minutes=1)), LONG_LEASE) as b,
    ):
        job_id = await submit(a.store)
        await a.supervisor.scan()
        await asyncio.wait_for(a.gate.reached.wait(), WAIT_S)
        await take_up(b)
        message = await logged(caplog, "stopping its driver")
        assert "coordinator 'coordinator-b' took it over (lease epoch 2)" in message, message
        a.gate.opened.set()  # too late: A's driver was stopped at its gate
        await asyncio.sleep(0.2)
        run = await a.store.get_current_run(job_id)
        assert (run.owner, run.round, run.lease_epoch) == ("coordinator-b", 1, 2)
        assert (await a.store.get_job(job_id)).state is JobState.RUNNING
        await finish_on_b(b, job_id)


async def test_a_dead_drivers_run_is_taken_over_as_its_lease_lapses_not_a_scan_later(db_url: str) -> None:
    """A replica whose scans are far apart (30 s here) still takes over a dead driver's run within the
    lease: finding the lease held, it scans again the moment the lease would lapse."""
    lease = timedelta(seconds=1)
    clock = SystemClock()
    async with replica(db_url, "coordinator-a", ManualClock(T0), LONG_LEASE) as a:
        job_id = await submit(a.store)
        # Coordinator A took the run a moment ago and died: its lease runs out in a second.
        run = await a.store.acquire_job_run(job_id, owner="coordinator-a", now=clock.now(), lease=lease)
    # B's scans are 30 s apart: no periodic scan could take the run over within the test's bound.
    async with replica(db_url, "coordinator-b", clock, lease, scan_seconds=30.0) as b:
        loop = asyncio.create_task(b.supervisor.loop().run(LoopPolicy()))
        try:
            await asyncio.wait_for(b.gate.reached.wait(), 10.0)  # its first scan found the lease held
        finally:
            loop.cancel()
            await asyncio.gather(loop, return_exceptions=True)
        taken = await b.store.get_current_run(job_id)
    assert (taken.run_id, taken.owner, taken.lease_epoch) == (run.run_id, "coordinator-b", 2)


# The scan reads the live jobs, then starts their drivers: by the time a driver holds the run, the job
# it was handed may be out of date. `_start(snapshot)` hands a driver exactly such a snapshot.


async def test_a_driver_handed_a_stale_pending_job_resumes_it_instead_of_failing_it(db_url: str) -> None:
    clock = ManualClock(T0)
    async with (
        replica(db_url, "coordinator-a", clock, LONG_LEASE) as a,
        replica(db_url, "coordinator-b", clock, LONG_LEASE) as b,
    ):
        job_id = await submit(a.store)
        snapshot = await b.store.get_job(job_id)  # PENDING, as B's scan read it
        await a.supervisor.scan()
        await asyncio.wait_for(a.gate.reached.wait(), WAIT_S)  # A made it RUNNING, checkpointed, froze
        clock.advance(LONG_LEASE + timedelta(seconds=1))
        b.supervisor._start(snapshot)
        # B holds the run and resumes it at round 1 (not "job cannot go from RUNNING to RUNNING").
        await asyncio.wait_for(b.gate.reached.wait(), WAIT_S)
        assert (await b.store.get_job(job_id)).state is JobState.RUNNING
        await finish_on_b(b, job_id)


@pytest.mark.parametrize("run_ended", [True, False], ids=["run-ended", "aborter-stopped-before-the-run"])
async def test_a_driver_handed_a_job_aborted_since_does_not_drive_it(db_url: str, run_ended: bool) -> None:
    clock = ManualClock(T0)
    async with (
        replica(db_url, "coordinator-a", clock, LONG_LEASE) as a,
        replica(db_url, "coordinator-b", clock, LONG_LEASE) as b,
    ):
        job_id = await submit(a.store)
        snapshot = await b.store.get_job(job_id)
        await a.supervisor.scan()
        await asyncio.wait_for(a.gate.reached.wait(), WAIT_S)
        run = await a.store.get_current_run(job_id)
        # An operator aborts it (as ControlService.abort_job does: the job, then its run), or got as far
        # as the job's state only (its coordinator killed in between).
        await JobEvents(a.store).set_state(job_id, JobState.ABORTED, "aborted by an operator")
        if run_ended:
            await a.store.finish_run(run.run_id, RunState.ABORTED, "aborted by an operator")
        ended = await a.store.get_current_run(job_id)
        clock.advance(LONG_LEASE + timedelta(seconds=1))
        b.supervisor._start(snapshot)
        await asyncio.wait_for(b.supervisor._drivers[job_id], WAIT_S)
        assert not b.gate.reached.is_set()
        now = await b.store.get_current_run(job_id)
        if run_ended:
            assert now == ended  # not leased to B, not a new run
        else:  # B ended the run the aborter left RUNNING
            assert (now.run_id, now.state, now.owner) == (run.run_id, RunState.ABORTED, None)
            assert now.message == "aborted by an operator"
        assert (await b.store.get_job(job_id)).state is JobState.ABORTED
        assert [e.kind for e in await b.store.list_job_events(job_id)][-1] == "job_state_changed"
