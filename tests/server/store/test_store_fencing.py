"""Contract: a run's writes fenced by its lease. Once another owner took the run over, a write fenced
with the old owner's token is refused (RunLeaseLost) and changes nothing; the new owner's goes through.
On SQLite (memory and file) and PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from fedlink.server.domain import (
    JobState,
    RunEnded,
    RunFence,
    RunLeaseHeld,
    RunLeaseLost,
    RunState,
    TaskState,
)
from fedlink.server.store import NewTask, SqlStateStore
from fedlink.server.store.testing import StoreFactory, World

LEASE = timedelta(seconds=30)


async def take_over(world: World, owner: str = "coordinator-2") -> RunFence:
    """Let coordinator-1's lease lapse and have ``owner`` take the run; return the new owner's fence."""
    later = world.clock.advance(LEASE + timedelta(seconds=1))
    taken = await world.store.acquire_run_lease(world.run.run_id, owner=owner, now=later, lease=LEASE)
    assert taken.owner == owner
    return taken.fence


def new_task(world: World, round: int = 1) -> NewTask:
    return NewTask(
        job_id=world.job.job_id,
        run_id=world.run.run_id,
        round=round,
        name="train",
        payload_sha256=None,
        deadline=world.clock.now() + timedelta(minutes=10),
        targets=(world.devices[0].device_id,),
    )


async def test_the_epoch_moves_only_when_another_owner_takes_the_lease(world: World) -> None:
    store, clock, run = world.store, world.clock, world.run
    assert run.lease_epoch == 1 and run.fence == RunFence(run_id=run.run_id, owner="coordinator-1", epoch=1)
    renewed = await store.acquire_run_lease(run.run_id, owner="coordinator-1", now=clock.now(), lease=LEASE)
    assert renewed.lease_epoch == 1
    renewed = await store.renew_run_lease(run.fence, now=clock.now(), lease=LEASE)
    assert (renewed.lease_epoch, renewed.owner_lease_expires_at) == (1, clock.now() + LEASE)
    with pytest.raises(RunLeaseHeld):
        await store.acquire_run_lease(run.run_id, owner="coordinator-2", now=clock.now(), lease=LEASE)
    assert (await store.get_run(run.run_id)).lease_epoch == 1  # a refused take-over moves nothing
    b = await take_over(world)
    assert b.epoch == 2
    a_again = await take_over(world, owner="coordinator-1")  # back to the first owner: a new epoch
    assert a_again.epoch == 3 and a_again != run.fence


async def test_after_a_take_over_the_old_owners_writes_are_refused_and_change_nothing(world: World) -> None:
    store, run, job = world.store, world.run, world.job
    stale = run.fence
    [task] = await store.create_tasks([new_task(world)], fence=stale)
    await store.save_checkpoint(run.run_id, 1, "1" * 64, '{"loss": 1.0}', keep_last=3, fence=stale)
    await store.set_job_state(job.job_id, JobState.RUNNING, fence=stale)
    before_events = await store.list_job_events(job.job_id)
    b = await take_over(world)
    taken = await store.get_run(run.run_id)

    refused = {
        "checkpoint": store.save_checkpoint(
            run.run_id,
            2,
            "2" * 64,
            '{"loss": 0.5}',
            keep_last=3,
            fence=stale,
            events=[("round_closed", '{"round": 2}')],
        ),
        "create_tasks": store.create_tasks([new_task(world, round=2)], fence=stale),
        "close_task": store.close_task(task.task_id, fence=stale),
        "close_tasks": store.close_tasks([task.task_id], fence=stale),
        "close_round_tasks": store.close_round_tasks(run_id=run.run_id, round=1, name="train", fence=stale),
        "cancel_task": store.cancel_task(task.task_id, fence=stale),
        "cancel_job_tasks": store.cancel_job_tasks(job.job_id, fence=stale),
        "count_round_retry": store.count_round_retry(run_id=run.run_id, round=1, name="train", fence=stale),
        "event": store.append_job_event(job.job_id, "round_closed", "{}", fence=stale),
        "job_state": store.set_job_state(job.job_id, JobState.FINISHED, fence=stale),
        "finish_run": store.finish_run(run.run_id, RunState.FINISHED, fence=stale),
        "renew": store.renew_run_lease(stale, now=world.clock.now(), lease=LEASE),
    }
    for what, write in refused.items():
        with pytest.raises(RunLeaseLost) as lost:
            await write
        message = str(lost.value)
        assert "coordinator 'coordinator-2' took it over (lease epoch 2)" in message, (what, message)
        assert "no longer driven by coordinator 'coordinator-1' (lease epoch 1)" in message, (what, message)

    # Nothing the stale writes touched moved.
    now = await store.get_run(run.run_id)
    assert (now.round, now.global_model_sha256, now.metrics_json) == (1, "1" * 64, '{"loss": 1.0}')
    assert (now.state, now.owner, now.lease_epoch) == (RunState.RUNNING, "coordinator-2", 2)
    assert now.owner_lease_expires_at == taken.owner_lease_expires_at  # the stale renewal did not extend it
    assert [c.round for c in await store.list_checkpoints(run.run_id)] == [1]
    assert [(t.task_id, t.state) for t in await store.list_tasks(run.run_id)] == [
        (task.task_id, TaskState.OPEN)
    ]
    assert await store.round_retries(run_id=run.run_id, round=1, name="train") == 0
    assert await store.list_job_events(job.job_id) == before_events
    assert (await store.get_job(job.job_id)).state is JobState.RUNNING

    # The new owner's writes go through, the checkpoint's event with it.
    await store.save_checkpoint(
        run.run_id, 2, "2" * 64, '{"loss": 0.5}', keep_last=3, fence=b, events=[("round_closed", "{}")]
    )
    after = await store.list_job_events(job.job_id)
    assert after[:-1] == before_events and after[-1].kind == "round_closed"
    assert await store.count_round_retry(run_id=run.run_id, round=1, name="train", fence=b) == 1
    assert await store.close_round_tasks(run_id=run.run_id, round=1, name="train", fence=b) == 1
    await store.create_tasks([new_task(world, round=2)], fence=b)
    await store.append_job_event(job.job_id, "round_started", "{}", fence=b)
    await store.set_job_state(job.job_id, JobState.FINISHED, fence=b)
    ended = await store.finish_run(run.run_id, RunState.FINISHED, fence=b)
    assert (ended.state, ended.round, ended.global_model_sha256) == (RunState.FINISHED, 2, "2" * 64)


async def test_a_lapsed_lease_nobody_took_still_fences_its_owners_writes_in(world: World) -> None:
    store, run = world.store, world.run
    world.clock.advance(LEASE * 3)  # paused past its lease, but no other coordinator came
    await store.save_checkpoint(run.run_id, 1, "1" * 64, "{}", keep_last=3, fence=run.fence)
    renewed = await store.renew_run_lease(run.fence, now=world.clock.now(), lease=LEASE)
    assert (renewed.round, renewed.lease_epoch, renewed.owner) == (1, 1, "coordinator-1")
    with pytest.raises(RunLeaseHeld):  # renewed: a take-over must wait for the renewed lease again
        await store.acquire_run_lease(run.run_id, owner="coordinator-2", now=world.clock.now(), lease=LEASE)


async def test_an_ended_run_refuses_its_drivers_writes(world: World) -> None:
    store, run = world.store, world.run
    await store.finish_run(run.run_id, RunState.ABORTED, "aborted by an operator")
    events = await store.list_job_events(world.job.job_id)
    with pytest.raises(RunLeaseLost, match=r"the run has ended \(ABORTED\)"):
        await store.save_checkpoint(
            run.run_id, 1, "1" * 64, "{}", keep_last=3, fence=run.fence, events=[("round_closed", "{}")]
        )
    assert await store.list_job_events(world.job.job_id) == events  # nor the round's event
    with pytest.raises(RunLeaseLost, match=r"the run has ended \(ABORTED\)"):
        await store.renew_run_lease(run.fence, now=world.clock.now(), lease=LEASE)
    ended = await store.get_run(run.run_id)
    assert ended.round == 0
    # Nobody takes an ended run's lease, its old owner or another, even once the lease lapsed.
    later = world.clock.advance(LEASE * 2)
    for owner in ("coordinator-1", "coordinator-2"):
        with pytest.raises(RunEnded, match=r"has ended \(ABORTED\)"):
            await store.acquire_job_run(world.job.job_id, owner=owner, now=later, lease=LEASE)
        with pytest.raises(RunEnded):
            await store.acquire_run_lease(run.run_id, owner=owner, now=later, lease=LEASE)
    assert await store.get_run(run.run_id) == ended


async def test_a_take_over_sees_every_write_the_old_owner_got_in(
    world: World, more_stores: StoreFactory
) -> None:
    # The old owner checkpoints as fast as it can from its own connections while the new owner takes the
    # run: whatever the new owner reads right after its take-over is the last checkpoint the old owner
    # ever got in (a write checked against the old epoch must not commit after the take-over).
    store, run = world.store, world.run
    old: SqlStateStore = await more_stores()
    rounds_in: list[int] = []
    three_in = asyncio.Event()

    async def old_driver() -> None:
        round_no = 0
        while True:
            round_no += 1
            try:
                await old.save_checkpoint(
                    run.run_id, round_no, f"{round_no:064x}", "{}", keep_last=2, fence=run.fence
                )
            except RunLeaseLost:
                return
            rounds_in.append(round_no)
            if len(rounds_in) == 3:
                three_in.set()
            await asyncio.sleep(0)

    writing = asyncio.create_task(old_driver())
    await asyncio.wait_for(three_in.wait(), timeout=30)
    await take_over(world)
    seen = (await store.get_run(run.run_id)).round
    await asyncio.wait_for(writing, timeout=30)
    after = await store.get_run(run.run_id)
    assert rounds_in and after.round == rounds_in[-1] == seen, (seen, rounds_in[-3:], after.round)


async def test_a_job_ended_before_its_run_refuses_its_drivers_events(world: World) -> None:
    # An operator's abort writes the job's final state (and its event), then ends the run: a driver's
    # checkpoint with its round's event, between the two, would put the round after the job's end.
    store, run, job = world.store, world.run, world.job
    await store.set_job_state(job.job_id, JobState.RUNNING, fence=run.fence)
    await store.set_job_state(
        job.job_id, JobState.ABORTED, "aborted by an operator", event=("job_state_changed", "{}")
    )
    events = await store.list_job_events(job.job_id)
    with pytest.raises(RunLeaseLost, match=r"job \S+ has ended \(ABORTED\)"):
        await store.save_checkpoint(
            run.run_id, 1, "1" * 64, "{}", keep_last=3, fence=run.fence, events=[("round_closed", "{}")]
        )
    with pytest.raises(RunLeaseLost, match=r"job \S+ has ended \(ABORTED\)"):
        await store.append_job_event(job.job_id, "round_started", "{}", fence=run.fence)
    assert await store.list_job_events(job.job_id) == events  # the abort's event stays the last
    assert await store.list_checkpoints(run.run_id) == []  # the checkpoint went with its event
    assert (await store.get_run(run.run_id)).round == 0
