"""Starts, resumes and stops the workflow driver of every live job.

Which coordinator drives a run is a lease recorded in the store, renewed while the driver runs; a
restarted coordinator (or another replica on the same database) takes over a run whose lease ran out
and resumes it from its last checkpoint.

Every run-state write a driver makes (tasks, round closes, checkpoints, the run's end) is fenced by the
lease it took (:class:`~fedlink.server.domain.RunFence`, checked in the write's own transaction). A
driver paused past its lease (SIGSTOP, a long GC pause, a partition) that wakes up after another
replica took the run over has its next write, or its next renewal, refused with RunLeaseLost: it stops
driving without touching the job, and this coordinator goes on as a plain replica for that job (its
scans try the lease again, and get it only once the other owner's lease runs out).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from fedlink.common.errors import FedlinkError, IllegalTransition, InvalidArgument, NotFound
from fedlink.server.coordination.known_tasks import KnownTasks
from fedlink.server.coordination.notify import TaskNotifier
from fedlink.server.coordination.progress import Progress, UpdateSink
from fedlink.server.domain import (
    Clock,
    Job,
    JobState,
    Run,
    RunEnded,
    RunFence,
    RunLeaseHeld,
    RunLeaseLost,
    RunState,
    is_final,
)
from fedlink.server.protocol.events import JobEvents
from fedlink.server.services.loops import Loop
from fedlink.server.store import StateStore, all_items, is_store_outage
from fedlink.server.workflows.base import WorkflowContext
from fedlink.server.workflows.registry import Workflows

log = logging.getLogger(__name__)

#: How a final job's run ends.
_RUN_END = {
    JobState.FINISHED: RunState.FINISHED,
    JobState.FAILED: RunState.FAILED,
    JobState.ABORTED: RunState.ABORTED,
}

#: How long after another replica's lease lapses this one tries to take its run: past the instant, so
#: that the store's clock comparison sees the lease expired.
_PAST_LEASE_S = 0.05


class JobSupervisor:
    """Keeps one driver task per pending or running job of this coordinator."""

    def __init__(
        self,
        store: StateStore,
        *,
        clock: Clock,
        notifier: TaskNotifier,
        events: JobEvents,
        owner: str,
        workflows: Workflows,
        run_lease: timedelta = timedelta(seconds=30),
        scan_seconds: float = 2.0,
        known_tasks: KnownTasks | None = None,
    ) -> None:
        self._store = store
        #: Shared with this process's device protocol: the tasks the workflows create.
        self._known_tasks = known_tasks if known_tasks is not None else KnownTasks()
        self._clock = clock
        self._notifier = notifier
        self._events = events
        self._owner = owner
        self._run_lease = run_lease
        self._scan_seconds = scan_seconds
        self._workflows = workflows
        self._drivers: dict[str, asyncio.Task[None]] = {}
        self._progress: dict[str, Progress] = {}
        self._wake = asyncio.Event()
        #: Tells the other replicas of a job's progress here, when this replica does not drive it:
        #: (job, the task reported or None, urgent). None on a store no other replica shares.
        self.relay: Callable[[str, str | None, bool], None] | None = None
        # Jobs being failed from outside their drivers (a corrupted blob found by a device's read).
        self._failing: set[asyncio.Task[None]] = set()

    def poke(self, job_id: str) -> None:
        """Tells the job's driver that the job changed (an abort, a new job), urgently, and has the
        jobs scanned again."""
        self.progress(job_id, urgent=True)
        self._wake.set()

    def progress(self, job_id: str, *, urgent: bool = False, task_id: str | None = None) -> None:
        """Tells the job's driver that its run moved, without a scan of the jobs (which jobs exist
        and in what state did not change): a report for ``task_id`` was recorded, or ``urgent``, leases
        ran out. If another replica drives the job, the relay (if any) tells it."""
        progress = self._driving(job_id)
        if progress is not None:
            progress.poke(urgent=urgent)
        elif self.relay is not None:
            self.relay(job_id, task_id, urgent)

    def heard(self, job_id: str, task_ids: Sequence[str], urgent: bool) -> None:
        """What another replica relayed of a job's progress (:meth:`progress` there): reports it recorded
        for ``task_ids``, or an ``urgent`` change. Reaches the job's driver if this replica runs it."""
        progress = self._driving(job_id)
        if progress is not None:
            progress.heard(task_ids, urgent=urgent)

    def _driving(self, job_id: str) -> Progress | None:
        """The job's Progress while this replica's driver of it runs (not one that found the run's lease
        held elsewhere and ended)."""
        driver = self._drivers.get(job_id)
        if driver is None or driver.done():
            return None
        return self._progress.get(job_id)

    def sink(self, job_id: str) -> UpdateSink | None:
        """Where the job's driver takes accepted updates now, if this coordinator drives it."""
        progress = self._progress.get(job_id)
        return None if progress is None else progress.sink

    def loop(self) -> Loop:
        """The supervisor as a background loop: scan, wait for a poke or ``scan_seconds``, again."""
        return Loop(name="job-supervisor", step=self.scan, pause=self._pause, close=self.close)

    async def _pause(self) -> None:
        try:
            async with asyncio.timeout(self._scan_seconds):
                await self._wake.wait()
        except TimeoutError:
            pass
        self._wake.clear()

    async def close(self) -> None:
        """Cancels every driver and waits for them (the loop's end)."""
        drivers = [*self._drivers.values(), *self._failing]
        for task in drivers:
            task.cancel()
        await asyncio.gather(*drivers, return_exceptions=True)

    def fail_jobs_using(self, sha256: str, message: str) -> None:
        """Fails, in the background, the live jobs that use blob ``sha256`` (found corrupted), with
        ``message``. A job whose driver read the blob fails by itself too; whichever is first wins."""
        task = asyncio.get_running_loop().create_task(
            self._fail_jobs_using(sha256, message), name=f"fail-jobs-using-{sha256[:12]}"
        )
        self._failing.add(task)
        task.add_done_callback(self._failing.discard)

    async def _fail_jobs_using(self, sha256: str, message: str) -> None:
        try:
            for job_id in await self._store.live_jobs_using_blob(sha256):
                await self.fail(job_id, message)
        except Exception as exc:  # the blob stays refused to every reader: only the job's end waits
            log.warning("could not fail the jobs using corrupted blob %s: %s", sha256, exc)

    async def fail(self, job_id: str, message: str) -> None:
        """Ends a live job as FAILED with ``message`` (its driver, if this coordinator runs one, stops
        at the next scan); a final job is left as it is."""
        job = await self._store.get_job(job_id)
        if is_final(job.state):
            return
        try:
            run: Run | None = await self._store.get_current_run(job_id)
        except NotFound:
            run = None
        await self._finish(job, run, JobState.FAILED, RunState.FAILED, message)
        log.warning("job %s failed: %s", job_id, message, extra={"job_id": job_id})
        self.poke(job_id)

    async def scan(self) -> None:
        """Starts a driver for every live job without one, and stops the drivers of final jobs."""
        # Ended drivers first, so that their jobs get a new one in this very scan: a driver that found
        # the run's lease held by another replica ends, and takes it over here once that lease lapsed.
        for job_id, task in list(self._drivers.items()):
            if task.done():
                del self._drivers[job_id]
                self._progress.pop(job_id, None)
                if not task.cancelled() and task.exception() is not None:
                    # Its job is still live (a final one would not be scanned): a new driver takes over.
                    log.error("driver of job %s ended with an error", job_id, exc_info=task.exception())
        for state in (JobState.RUNNING, JobState.PENDING):
            for job in await self._jobs_in(state):
                if job.job_id not in self._drivers:
                    self._start(job)
        for job_id, task in list(self._drivers.items()):
            if task.done():
                continue
            job = await self._store.get_job(job_id)
            if is_final(job.state):  # aborted by an operator (possibly on another replica)
                task.cancel()

    async def _jobs_in(self, state: JobState) -> list[Job]:
        return await all_items(
            lambda token: self._store.list_jobs(page_size=200, page_token=token, state=state)
        )

    def _start(self, job: Job) -> None:
        self._progress[job.job_id] = Progress()
        self._drivers[job.job_id] = asyncio.create_task(self._drive(job), name=f"job-{job.job_id}")

    async def _drive(self, job: Job) -> None:
        try:
            run = await self._acquire_run(job)
            # The scan's snapshot of the job may predate the run's last driver (which moved it to
            # RUNNING) or an abort: what to do is decided on the job as it is, now that the run is held.
            job = await self._store.get_job(job.job_id)
        except RunLeaseHeld as held:
            # Another coordinator drives it. Scan again the moment its lease would lapse, not up to a
            # scan later: a replica that died has its runs taken over within the lease.
            self._wake_at(held.expires_at)
            return
        except RunEnded:
            return  # the job was ended (its state first, then its run's) since the scan read it
        except Exception as exc:
            if not is_store_outage(exc):
                raise
            log.warning("cannot take up job %s now: %s", job.job_id, exc, extra={"job_id": job.job_id})
            return
        if is_final(job.state):
            await self._end_run_of_ended_job(job, run)
            return
        fence = run.fence
        driver = asyncio.current_task()
        assert driver is not None
        renewer = asyncio.create_task(self._renew(fence, driver), name=f"run-lease-{run.run_id}")
        try:
            if job.state is JobState.PENDING:
                job = await self._events.set_state(job.job_id, JobState.RUNNING, fence=fence)
            try:
                workflow = self._workflows.build(job.workflow)
            except ValueError as exc:  # a spec_json that is not a workflow spec at all
                raise InvalidArgument(f"job {job.job_id} has no readable workflow spec: {exc}") from None
            ctx = WorkflowContext(
                store=self._store,
                clock=self._clock,
                notifier=self._notifier,
                progress=self._progress[job.job_id],
                events=self._events,
                job=job,
                run=run,
                known_tasks=self._known_tasks,
            )
            await workflow.run(ctx)
            await self._finish(job, run, JobState.FINISHED, RunState.FINISHED, "", fence=fence)
            log.info("job finished", extra={"job_id": job.job_id})
        except asyncio.CancelledError:
            raise
        except RunLeaseLost as lost:
            # Not the job's failure: another coordinator drives the run now (or it ended); what this
            # driver had not written yet is the new driver's to redo from the last checkpoint.
            log.warning(
                "stopped driving job %s: %s",
                job.job_id,
                lost,
                extra={"job_id": job.job_id, "run_id": run.run_id},
            )
            return
        except Exception as exc:
            if is_store_outage(exc):
                # The database failed the driver, not the job: the next scan starts a driver again, which
                # resumes the run from its last checkpoint (and the scan's own retries cover an outage).
                log.warning(
                    "driver of job %s stopped by a store outage; it resumes at the next scan: %s",
                    job.job_id,
                    exc,
                    extra={"job_id": job.job_id},
                )
                return
            message = exc.message if isinstance(exc, FedlinkError) else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, FedlinkError):
                log.exception("workflow of job %s failed", job.job_id)
            try:
                await self._finish(job, run, JobState.FAILED, RunState.FAILED, message, fence=fence)
            except RunLeaseLost as lost:
                log.warning(
                    "job %s not failed (%s): %s",
                    job.job_id,
                    message,
                    lost,
                    extra={"job_id": job.job_id, "run_id": run.run_id},
                )
        finally:
            renewer.cancel()
            self._notifier.notify(job.job_id)  # long polls of this job answer DONE now

    async def _finish(
        self,
        job: Job,
        run: Run | None,
        state: JobState,
        run_state: RunState,
        message: str,
        *,
        fence: RunFence | None = None,
    ) -> None:
        """Ends the job and its run; a driver passes its ``fence`` (RunLeaseLost if it lost the run)."""
        current = await self._store.get_job(job.job_id)
        if is_final(current.state):
            return
        try:
            await self._store.cancel_job_tasks(job.job_id, fence=fence)
            # The job before the run: a final job is not scanned, so no replica takes up its ended run.
            job = await self._events.set_state(job.job_id, state, message, fence=fence)
            if run is not None:
                await self._store.finish_run(run.run_id, run_state, message, fence=fence)
        except IllegalTransition:
            return  # ended meanwhile by someone else (an operator, a corrupted blob's discovery)

    async def _end_run_of_ended_job(self, job: Job, run: Run) -> None:
        """Ends the run of a job that ended without it: its ender writes the job's state, then the run's,
        and may have stopped in between (a coordinator killed mid-abort), or be about to write it."""
        try:
            await self._store.finish_run(run.run_id, _RUN_END[job.state], job.message, fence=run.fence)
        except (RunLeaseLost, IllegalTransition):
            return  # ended meanwhile, by the job's ender
        except Exception as exc:
            if not is_store_outage(exc):
                raise
            return  # the run stays RUNNING for now; nobody drives a final job's run
        log.info(
            "ended the run of final job %s", job.job_id, extra={"job_id": job.job_id, "run_id": run.run_id}
        )

    def _wake_at(self, moment: datetime | None) -> None:
        """Has the jobs scanned at ``moment`` (soon after it, on this coordinator's clock)."""
        if moment is None:
            return
        delay = (moment - self._clock.now()).total_seconds() + _PAST_LEASE_S
        if delay < self._scan_seconds:  # a later lapse is the next scan's to notice
            asyncio.get_running_loop().call_later(max(delay, 0.0), self._wake.set)

    async def _acquire_run(self, job: Job) -> Run:
        return await self._store.acquire_job_run(
            job.job_id, owner=self._owner, now=self._clock.now(), lease=self._run_lease
        )

    async def _renew(self, fence: RunFence, driver: asyncio.Task[None]) -> None:
        """Renews the driver's lease every third of it; stops the driver once it is lost."""
        while True:
            await asyncio.sleep(self._run_lease.total_seconds() / 3)
            try:
                await self._store.renew_run_lease(fence, now=self._clock.now(), lease=self._run_lease)
            except RunLeaseLost as lost:
                # The driver's own next write would be refused anyway: stop it before it does more work.
                log.warning("%s; stopping its driver", lost, extra={"run_id": fence.run_id})
                driver.cancel()
                return
            except Exception as exc:  # tried again in a third of the lease; two misses are still in time
                log.warning(
                    "renewing the lease of run %s failed: %s",
                    fence.run_id,
                    exc,
                    extra={"run_id": fence.run_id},
                )
