"""Refreshes the coordinator's domain gauges from the store: devices, jobs, round progress, and FedBuff's
model versions, buffered updates and selection."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from fedlink.common.errors import InvalidArgument, NotFound
from fedlink.server.domain import TRAIN_TASK, Job, JobState, Run
from fedlink.server.services.loops import Loop
from fedlink.server.store import StateStore, all_items
from fedlink.server.telemetry import Telemetry
from fedlink.server.workflows import registry
from fedlink.server.workflows.fedbuff import FedBuffParams, progress_of

log = logging.getLogger(__name__)


class MetricsCollector:
    """Reads counts from the store every ``interval`` into :class:`Telemetry`'s gauges.

    Reading from the store (rather than counting events in-process) keeps the gauges right across
    restarts and across coordinator replicas sharing one database. Each running job costs a few
    aggregate queries: its run, then its open round's summary, or for FedBuff one summary per model
    version with tasks out (see :func:`~fedlink.server.workflows.fedbuff.progress_of`).
    """

    def __init__(self, store: StateStore, telemetry: Telemetry, *, interval: timedelta) -> None:
        self._store = store
        self._telemetry = telemetry
        self._interval = interval.total_seconds()
        self._running: set[str] = set()

    def loop(self) -> Loop:
        """The gauges' refresh as a background loop, every ``interval``."""
        return Loop(name="metrics", step=self.refresh, pause=self._pause)

    async def _pause(self) -> None:
        await asyncio.sleep(self._interval)

    async def refresh(self) -> None:
        """One refresh of every domain gauge."""
        self._telemetry.set_devices(await self._store.count_devices_by_state())
        self._telemetry.set_jobs(await self._store.count_jobs_by_state())
        running: set[str] = set()
        running_jobs = await all_items(
            lambda token: self._store.list_jobs(page_size=1000, page_token=token, state=JobState.RUNNING)
        )
        for job in running_jobs:
            try:
                run = await self._store.get_current_run(job.job_id)
            except NotFound:
                continue
            fedbuff = _fedbuff_params(job)
            if fedbuff is not None:
                progress = await progress_of(self._store, run)
                self._telemetry.set_model_version(
                    job.job_id,
                    progress.version,
                    buffered=progress.buffered,
                    selection_filled=progress.selection_filled,
                    selection_size=fedbuff.device_selection_size,
                )
            else:
                await self._set_round(job, run)
            running.add(job.job_id)
        for job_id in self._running - running:
            self._telemetry.forget_job(job_id)
        self._running = running

    async def _set_round(self, job: Job, run: Run) -> None:
        open_round = run.round + 1
        summary = await self._store.round_summary(run_id=run.run_id, round=open_round, name=TRAIN_TASK)
        self._telemetry.set_round(job.job_id, open_round, summary.succeeded)


def _fedbuff_params(job: Job) -> FedBuffParams | None:
    """The job's FedBuff parameters, or None for a job of another workflow (or an unreadable spec)."""
    try:
        spec = job.workflow
        if spec.name != "fedbuff":
            return None
        params = registry.parse(spec)
    except (ValueError, InvalidArgument):
        return None
    return params if isinstance(params, FedBuffParams) else None
