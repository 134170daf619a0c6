"""Scheduled collection: what nothing uses any more is deleted, so the store does not grow without end.

Every ``interval``, the first time one interval after the start (the first collection of a process
also looks at every blob, and clears what a crash left behind):

* blobs nothing points at that were stored before ``unused_blob_ttl`` ago: a device's upload it never
  reported, a model uploaded and never submitted, a checkpoint's model left by a crash (the payloads
  of refused, late or conflicting reports are never kept at all: see ``record_results``);
* partial uploads idle for ``stale_upload_ttl``, with their bytes, and the markers of complete uploads
  a device never used (they count against its upload quota until then);
* the events of finished jobs beyond their newest ``max_finished_job_events``, and all but the last
  of a job finished ``finished_job_events_ttl`` ago. A pending or running job keeps every event.

The loop runs under :class:`~fedlink.server.services.loops.BackgroundLoops`, like the maintenance loop:
a failing collection is retried with backoff, and the coordinator stops if it never recovers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import timedelta

from fedlink.server.domain import Clock
from fedlink.server.services.loops import Loop
from fedlink.server.store import CollectedBlobs, StateStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectionPolicy:
    """What is collected, and when."""

    #: Time between two collections.
    interval: timedelta = timedelta(minutes=10)
    #: Age (since last stored) after which a blob nothing uses is deleted.
    unused_blob_ttl: timedelta = timedelta(hours=1)
    #: Idle time after which a partial upload is discarded.
    stale_upload_ttl: timedelta = timedelta(hours=24)
    #: Time after its end when a finished job keeps only its last event.
    finished_job_events_ttl: timedelta = timedelta(days=30)
    #: Events a finished job keeps at most (its newest).
    max_finished_job_events: int = 10_000


@dataclass(frozen=True, slots=True, kw_only=True)
class Collected:
    """What one collection deleted."""

    blobs: CollectedBlobs
    job_events: int

    @property
    def anything(self) -> bool:
        """Whether it deleted anything at all."""
        b = self.blobs
        return bool(b.blobs or b.uploads or b.orphan_files or self.job_events)


class Collection:
    """The coordinator's scheduled collection (a :class:`Loop` of :meth:`collect`)."""

    def __init__(self, store: StateStore, *, clock: Clock, policy: CollectionPolicy) -> None:
        self._store = store
        self._clock = clock
        self._policy = policy
        self._started = False

    def loop(self) -> Loop:
        """The collection as a background loop: wait ``interval``, collect, again."""
        return Loop(name="collection", step=self._step, pause=self._pause)

    async def _step(self) -> None:
        # Not at once: a starting coordinator does its own first steps (and a crash-looping one is not
        # slowed down by a sweep of every blob each time).
        if self._started:
            await self.collect()
        self._started = True

    async def _pause(self) -> None:
        await asyncio.sleep(self._policy.interval.total_seconds())

    async def collect(self) -> Collected:
        """Deletes, once, what nothing uses any more (see the module docstring)."""
        policy, now = self._policy, self._clock.now()
        blobs = await self._store.blobs.collect(
            unused_before=now - policy.unused_blob_ttl, idle_uploads_before=now - policy.stale_upload_ttl
        )
        events = await self._store.prune_job_events(
            finished_before=now - policy.finished_job_events_ttl, keep_per_job=policy.max_finished_job_events
        )
        collected = Collected(blobs=blobs, job_events=events)
        if collected.anything:
            log.info(
                "collected %d unused blobs, %d idle uploads, %d orphan files (%d bytes) and %d job events",
                blobs.blobs,
                blobs.uploads,
                blobs.orphan_files,
                blobs.total_bytes,
                events,
                extra={
                    "blobs": blobs.blobs,
                    "uploads": blobs.uploads,
                    "orphan_files": blobs.orphan_files,
                    "bytes": blobs.total_bytes,
                    "job_events": events,
                },
            )
        return collected
