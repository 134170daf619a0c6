"""The store rides out PostgreSQL connections that the server terminates (a restart, a failover,
``pg_terminate_backend``): every write is applied once, reads answer, and an outage longer than the retry
budget is UNAVAILABLE with a ``retry_after`` until the database answers again.

The connections are terminated by the real server, from outside (:meth:`PgFaults.terminate`) or from
inside the store's own connection at a chosen statement or commit (:meth:`PgFaults.kill_before`,
:meth:`PgFaults.lose_commit`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest

from fedlink.common.errors import Unavailable
from fedlink.server.domain import ManualClock
from fedlink.server.store import (
    NewTask,
    SqlStateStore,
    StoreRetryPolicy,
    StoreUnavailable,
    is_connection_loss,
    open_store,
)
from fedlink.server.store.dialect import Database
from fedlink.server.store.outages import is_store_away
from fedlink.server.store.testing import PgFaults, World, make_world

pytestmark = pytest.mark.postgres

RETRIES = "fedlink.server.store.outages"
TASKS_INSERT = r"INSERT INTO tasks\b"
ROUND_COUNTS_WRITE = r"INSERT INTO round_counts\b"


@dataclass
class Broken:
    """A store on the test's PostgreSQL database, and the faults to break its connections with."""

    store: SqlStateStore
    faults: PgFaults
    world: World


@pytest.fixture
async def broken(pg_url: str, clock: ManualClock) -> AsyncIterator[Broken]:
    policy = StoreRetryPolicy(budget=timedelta(seconds=5), retry_after=timedelta(seconds=3))
    async with open_store(pg_url, clock=clock, retry=policy) as store:
        world = await make_world(store, clock, devices=4)
        async with PgFaults(store.database, pg_url) as faults:
            yield Broken(store, faults, world)


def _new_tasks(world: World, count: int) -> list[NewTask]:
    return [
        NewTask(
            job_id=world.job.job_id,
            run_id=world.run.run_id,
            round=1,
            name="train",
            payload_sha256=None,
            deadline=world.clock.now() + timedelta(minutes=10),
            targets=(world.devices[i].device_id,),
        )
        for i in range(count)
    ]


def _retries_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == RETRIES and "retrying" in r.getMessage()]


async def test_connections_the_server_closed_while_idle_are_replaced_at_checkout(
    broken: Broken, caplog: pytest.LogCaptureFixture
) -> None:
    store, world = broken.store, broken.world
    await asyncio.gather(*(store.get_job(world.job.job_id) for _ in range(4)))  # several pooled connections
    assert await broken.faults.terminate() >= 1
    await asyncio.sleep(0.1)  # the driver reads the server's goodbye
    with caplog.at_level(logging.DEBUG, logger=RETRIES):
        job = await store.get_job(world.job.job_id)
        await store.create_tasks(_new_tasks(world, 1))
    assert job.job_id == world.job.job_id
    # Replaced before use: nothing broke, so nothing was retried.
    assert _retries_logged(caplog) == []


async def test_a_write_cut_off_before_its_commit_runs_again_once(
    broken: Broken, caplog: pytest.LogCaptureFixture
) -> None:
    store, world = broken.store, broken.world
    broken.faults.kill_before(TASKS_INSERT)
    with caplog.at_level(logging.DEBUG, logger=RETRIES):
        made = await store.create_tasks(_new_tasks(world, 3))
    assert broken.faults.fired["killed"] == 1
    assert _retries_logged(caplog), "the cut-off transaction was not retried"
    stored = await store.list_tasks(world.run.run_id)
    assert sorted(t.task_id for t in stored) == sorted(t.task_id for t in made)


async def test_a_write_whose_commit_answer_was_lost_is_not_applied_twice(broken: Broken) -> None:
    store, world = broken.store, broken.world
    run_id = world.run.run_id
    # An increment: run again after a commit that went through, it would count two.
    broken.faults.lose_commit(ROUND_COUNTS_WRITE, committed=True)
    assert await store.count_round_retry(run_id=run_id, round=1, name="train") == 1
    assert broken.faults.fired["commit lost"] == 1
    assert await store.round_retries(run_id=run_id, round=1, name="train") == 1
    # Tasks: run again, the same ids would collide with the committed ones.
    broken.faults.lose_commit(TASKS_INSERT, committed=True)
    made = await store.create_tasks(_new_tasks(world, 3))
    assert broken.faults.fired["commit lost"] == 2
    stored = await store.list_tasks(run_id)
    assert sorted(t.task_id for t in stored) == sorted(t.task_id for t in made)


async def test_a_write_whose_commit_was_cut_off_before_it_committed_runs_again(broken: Broken) -> None:
    store, world = broken.store, broken.world
    run_id = world.run.run_id
    broken.faults.lose_commit(ROUND_COUNTS_WRITE, committed=False)
    # Returned as if committed, the increment would be lost: 0 stored.
    assert await store.count_round_retry(run_id=run_id, round=1, name="train") == 1
    assert broken.faults.fired["commit cut"] == 1
    assert await store.round_retries(run_id=run_id, round=1, name="train") == 1


async def _stored_blob(store: SqlStateStore) -> str:
    return (await store.blobs.put_bytes(b"a model, say")).sha256


READS: dict[str, Callable[[Broken, str], Awaitable[Any]]] = {
    "get_job": lambda b, sha: b.store.get_job(b.world.job.job_id),
    "list_jobs": lambda b, sha: b.store.list_jobs(),
    "get_current_run": lambda b, sha: b.store.get_current_run(b.world.job.job_id),
    "list_tasks": lambda b, sha: b.store.list_tasks(b.world.run.run_id),
    "round_summary": lambda b, sha: b.store.round_summary(run_id=b.world.run.run_id, round=1, name="train"),
    "list_results": lambda b, sha: b.store.list_results(run_id=b.world.run.run_id),
    "online_devices": lambda b, sha: b.store.online_devices(with_info=True),
    "authenticate_device": lambda b, sha: b.store.authenticate_device("cred-1"),
    "has_claimable": lambda b, sha: b.store.has_claimable(
        b.world.devices[0].device_id, b.world.job.job_id, b.world.clock.now()
    ),
    "blobs.stat": lambda b, sha: b.store.blobs.stat(sha),
    "blobs.read": lambda b, sha: b.store.blobs.read(sha),
}


@pytest.mark.parametrize("read", list(READS))
async def test_a_read_whose_connection_broke_answers_all_the_same(broken: Broken, read: str) -> None:
    sha = await _stored_blob(broken.store)
    await broken.store.create_tasks(_new_tasks(broken.world, 2))
    expected = await READS[read](broken, sha)
    broken.faults.kill_before(r"^\s*SELECT\b")
    assert await READS[read](broken, sha) == expected
    assert broken.faults.fired["killed"] == 1


async def test_a_short_outage_is_waited_out_within_the_budget(broken: Broken) -> None:
    store, world = broken.store, broken.world
    await broken.faults.refuse()
    write = asyncio.create_task(store.create_tasks(_new_tasks(world, 2)))
    read = asyncio.create_task(store.get_job(world.job.job_id))
    await asyncio.sleep(1.0)
    assert not write.done() and not read.done()  # retrying, not failed
    await broken.faults.allow()
    made = await asyncio.wait_for(write, 10)
    assert (await asyncio.wait_for(read, 10)).job_id == world.job.job_id
    assert len(await store.list_tasks(world.run.run_id)) == len(made) == 2
    assert store.database.availability.available


async def test_an_outage_beyond_the_budget_is_unavailable_with_retry_after_until_the_database_answers(
    pg_url: str, clock: ManualClock
) -> None:
    budget = timedelta(seconds=1)
    policy = StoreRetryPolicy(budget=budget, retry_after=timedelta(seconds=3))
    async with open_store(pg_url, clock=clock, retry=policy) as store:
        world = await make_world(store, clock, devices=2)
        changes: list[bool] = []
        store.database.availability.subscribe(changes.append)
        async with PgFaults(store.database, pg_url) as faults:
            await faults.refuse()
            started = time.monotonic()
            with pytest.raises(StoreUnavailable) as first:
                await store.get_job(world.job.job_id)
            assert time.monotonic() - started >= budget.total_seconds() * 0.9  # the budget was spent
            assert first.value.retry_after == timedelta(seconds=3)
            assert isinstance(first.value, Unavailable) and is_store_away(first.value)
            assert changes == [False] and not store.database.availability.available
            # While the store is away, calls fail at once (no budget of their own), writes too.
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.create_tasks(_new_tasks(world, 1))
            assert time.monotonic() - started < 0.5
            assert not await store.database.probe()
            await faults.allow()
            assert await store.database.probe()
            assert changes == [False, True] and store.database.availability.available
            assert (await store.get_job(world.job.job_id)).job_id == world.job.job_id


async def test_nothing_is_retried_before_the_database_answered_once() -> None:
    # A server that is not there at start is the driver's own error, at once (a wrong URL, say).
    database = Database("postgresql+asyncpg://postgres@127.0.0.1:1/nowhere")
    try:
        started = time.monotonic()
        with pytest.raises(OSError) as refused:
            async with database.read():
                pass
        assert time.monotonic() - started < 2
        assert is_connection_loss(refused.value)
    finally:
        await database.dispose()
