"""Store reads that thousands of concurrent device calls share: the same job, the jobs in one state.

A round's worth of devices woken together all read their job at once; one store read per distinct job
answers a whole batch. A :class:`~fedlink.server.protocol.batching.Batcher` starts a read only after
the requests it answers arrived, so every caller still sees the store as it was after its call began.
"""

from __future__ import annotations

from collections.abc import Sequence

from fedlink.common.errors import NotFound
from fedlink.server.domain import Job, JobState
from fedlink.server.protocol.batching import Batcher
from fedlink.server.store import StateStore, all_items

#: Requests answered by one batch (the distinct keys in it are few: one job, two states).
_BATCH = 100_000
#: Page size when listing the jobs in a state.
_PAGE = 200
#: While reads are asked for together, how long a read waits for more askers (see Batcher).
_LINGER_SECONDS = 0.01


class JobReads:
    """Coalesced reads of jobs for the device protocol."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._jobs: Batcher[str, Job] = Batcher(self._job_batch, max_batch=_BATCH, linger=_LINGER_SECONDS)
        self._states: Batcher[JobState, list[Job]] = Batcher(
            self._state_batch, max_batch=_BATCH, linger=_LINGER_SECONDS
        )
        self._named: Batcher[str, list[Job]] = Batcher(self._named_batch, max_batch=_BATCH)

    async def job(self, job_id: str) -> Job:
        """The job as the store has it now; NotFound if unknown."""
        return await self._jobs.submit(job_id)

    async def in_state(self, state: JobState) -> list[Job]:
        """Every job in ``state`` (all pages)."""
        return await self._states.submit(state)

    async def named(self, name: str) -> list[Job]:
        """Every job called ``name``, final ones included (walks the whole history: rare)."""
        return await self._named.submit(name)

    async def _named_batch(self, names: Sequence[str]) -> list[list[Job] | BaseException]:
        every = await all_items(lambda token: self._store.list_jobs(page_size=_PAGE, page_token=token))
        return [[job for job in every if job.name == name] for name in names]

    async def _job_batch(self, job_ids: Sequence[str]) -> list[Job | BaseException]:
        read: dict[str, Job | BaseException] = {}
        for job_id in dict.fromkeys(job_ids):
            try:
                read[job_id] = await self._store.get_job(job_id)
            except NotFound as exc:
                read[job_id] = exc
        return [read[job_id] for job_id in job_ids]

    async def _state_batch(self, states: Sequence[JobState]) -> list[list[Job] | BaseException]:
        listed = {state: await self._list(state) for state in dict.fromkeys(states)}
        return [listed[state] for state in states]

    async def _list(self, state: JobState) -> list[Job]:
        return await all_items(
            lambda token: self._store.list_jobs(page_size=_PAGE, page_token=token, state=state)
        )
