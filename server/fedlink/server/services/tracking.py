"""The coordinator's experiment tracking: each round (or model version) its workflows close goes to the
configured metric sinks (MLflow, TensorBoard: :mod:`fedlink.server.tracking`).

:class:`JobTracker` hears every event this coordinator records (``JobEvents.listeners``), so only the
coordinator that drives a run logs its rounds. It queues them without waiting and hands them to the
sinks in order, on a thread of its own (the sinks' libraries block on files and databases): a slow or
broken sink never holds a workflow back, and a broken one is disabled after logging once.

A round's event can reach the tracker after its job's final state even though the store records it
first: the listeners hear events as their writes return, and a driver's checkpoint (with its round's
event) and an operator's abort can return in either order. Such a late round is logged and the job's
runs are ended again, so the sinks keep the round and the job's final status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from fedlink.server.domain import Job, JobState, is_final
from fedlink.server.protocol.events import JOB_STATE_CHANGED
from fedlink.server.services.loops import Loop
from fedlink.server.tracking.sinks import MetricPoint, MetricSink, TrackedJob

log = logging.getLogger(__name__)

__all__ = ["JobTracker"]

#: How many ended jobs the tracker remembers for rounds that arrive after the job's end.
_ENDED_KEPT = 256


@dataclass(frozen=True, slots=True)
class _Event:
    job: Job
    kind: str
    round: int
    payload: Mapping[str, Any]
    time_s: float


class JobTracker:
    """Feeds the metric sinks from the job events of this coordinator."""

    def __init__(self, sinks: Sequence[MetricSink]) -> None:
        self._sinks = list(sinks)
        self._queue: asyncio.Queue[_Event] = asyncio.Queue()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedlink-tracking")
        # Touched only on the executor's one thread.
        self._jobs: dict[str, TrackedJob] = {}
        self._round_starts: dict[tuple[str, int], tuple[float, int]] = {}
        self._last_step_time: dict[str, float] = {}
        #: Ended jobs (newest last) with their final state.
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._closed = False

    def heard(self, job: Job, kind: str, round: int, payload: Mapping[str, Any]) -> None:
        """A ``JobEvents`` listener: queues the event (never blocks, never raises)."""
        if self._closed:
            return
        self._queue.put_nowait(_Event(job, kind, round, dict(payload), time.time()))

    def loop(self) -> Loop:
        """The delivery as a background loop; when it ends, the queue is delivered and the sinks closed."""
        return Loop(name="tracking", step=self._deliver_next, pause=_no_pause, close=self.close)

    async def _deliver_next(self) -> None:
        event = await self._queue.get()
        await asyncio.get_running_loop().run_in_executor(self._executor, self._deliver, event)

    async def close(self) -> None:
        """Delivers what is queued, then closes the sinks; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        pending: list[_Event] = []
        while not self._queue.empty():
            pending.append(self._queue.get_nowait())

        def finish() -> None:
            for event in pending:
                self._deliver(event)
            for sink in self._sinks:
                sink.close()

        await asyncio.get_running_loop().run_in_executor(self._executor, finish)
        self._executor.shutdown(wait=True)

    # ---- on the tracking thread ----

    def _tracked(self, job: Job) -> TrackedJob:
        tracked = self._jobs.get(job.job_id)
        if tracked is None:
            try:
                spec = job.workflow
                workflow, params = spec.name, dict(spec.config)
            except ValueError:
                workflow, params = "unknown", {}
            tracked = TrackedJob(job_id=job.job_id, name=job.name, workflow=workflow, params=params)
            self._jobs[job.job_id] = tracked
            for sink in self._sinks:
                sink.start(tracked)
        return tracked

    def _deliver(self, event: _Event) -> None:
        try:
            self._dispatch(event)
        except Exception:  # a bad payload must not stop the tracking of every other job
            log.exception("could not track a %s event", event.kind, extra={"job_id": event.job.job_id})

    def _dispatch(self, event: _Event) -> None:
        job_id = event.job.job_id
        if event.kind == "round_started":
            if job_id in self._ended:
                return  # no round of an ended job closes after it
            sampled = int(event.payload.get("num_devices", 0))
            self._round_starts[(job_id, event.round)] = (event.time_s, sampled)
        elif event.kind == "round_closed":
            started, sampled = self._round_starts.pop((job_id, event.round), (event.time_s, 0))
            self._log(
                event,
                num_devices=sampled,
                num_results=int(event.payload.get("num_results", 0)),
                duration_s=event.time_s - started,
            )
        elif event.kind == "model_version":
            previous = self._last_step_time.get(job_id, event.time_s)
            self._last_step_time[job_id] = event.time_s
            self._log(
                event,
                num_devices=int(event.payload.get("selection", 0)),
                num_results=int(event.payload.get("num_updates", 0)),
                duration_s=event.time_s - previous,
            )
        elif event.kind == JOB_STATE_CHANGED:
            state = JobState(str(event.payload.get("state")))
            if state is JobState.RUNNING:
                self._last_step_time.setdefault(job_id, event.time_s)  # the first version's start
            if is_final(state):
                self._ended[job_id] = state.value
                if len(self._ended) > _ENDED_KEPT:  # its rounds' starts go with it (a late round's kept)
                    forgotten, _ = self._ended.popitem(last=False)
                    for key in [k for k in self._round_starts if k[0] == forgotten]:
                        del self._round_starts[key]
                self._last_step_time.pop(job_id, None)
                self._finish(job_id)

    def _finish(self, job_id: str) -> None:
        """Ends the runs of an ended job that the sinks have open."""
        tracked = self._jobs.pop(job_id, None)
        if tracked is not None:
            for sink in self._sinks:
                sink.finish(tracked, self._ended[job_id])

    def _log(self, event: _Event, *, num_devices: int, num_results: int, duration_s: float) -> None:
        metrics = event.payload.get("metrics") or {}
        point = MetricPoint(
            step=event.round,
            metrics={str(k): float(v) for k, v in json.loads(json.dumps(metrics)).items()},
            num_devices=num_devices,
            num_results=num_results,
            duration_s=max(0.0, duration_s),
            time_s=event.time_s,
        )
        tracked = self._tracked(event.job)
        for sink in self._sinks:
            sink.log(tracked, point)
        if event.job.job_id in self._ended:  # a late round: the job's runs end as the job did
            self._finish(event.job.job_id)


async def _no_pause() -> None:
    return None
