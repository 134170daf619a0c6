"""A workflow's events through its context, on a real store: a checkpoint's events are recorded in its
transaction (in the job's order, heard by the listeners after), an event of an unknown kind or with
foreign keys is refused before anything is written, and a driver that lost its run records none.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from fedlink.common.dxo import DXO, DataKind
from fedlink.common.errors import InvalidArgument
from fedlink.server.coordination.notify import LocalTaskNotifier
from fedlink.server.coordination.progress import Progress
from fedlink.server.domain import Job, ManualClock, RunLeaseLost, RunState
from fedlink.server.protocol.events import JobEvents
from fedlink.server.store import SqlStateStore, open_store
from fedlink.server.store.testing import World, make_world
from fedlink.server.workflows.base import WorkflowContext


@pytest.fixture
async def world() -> AsyncIterator[World]:
    clock = ManualClock()
    async with open_store("sqlite+aiosqlite:///:memory:", clock=clock, auto_migrate=True) as store:
        yield await make_world(store, clock)


def context(world: World, heard: list[tuple[str, int]]) -> WorkflowContext:
    events = JobEvents(world.store)

    def listen(job: Job, kind: str, round: int, payload: Mapping[str, Any]) -> None:
        heard.append((kind, round))

    events.listeners.append(listen)
    return WorkflowContext(
        store=world.store,
        clock=world.clock,
        notifier=LocalTaskNotifier(),
        progress=Progress(),
        events=events,
        job=world.job,
        run=world.run,
    )


def model(value: float) -> DXO:
    return DXO(kind=DataKind.WEIGHTS, data={"w": np.full(3, value, np.float32)})


async def kinds(store: SqlStateStore, job_id: str) -> list[tuple[str, int]]:
    return [(e.kind, json.loads(e.payload_json)["round"]) for e in await store.list_job_events(job_id)]


async def test_a_checkpoints_events_are_recorded_with_it_in_order_and_heard(world: World) -> None:
    heard: list[tuple[str, int]] = []
    ctx = context(world, heard)
    await ctx.emit("round_started", 1, {"num_devices": 2})
    closed = ("round_closed", 1, {"num_results": 2, "metrics": {"loss": 0.5}})
    await ctx.checkpoint(1, model(1.0), metrics={"loss": 0.5}, events=[closed])
    assert await kinds(world.store, world.job.job_id) == [("round_started", 1), ("round_closed", 1)]
    assert heard == [("round_started", 1), ("round_closed", 1)]
    (event,) = (await world.store.list_job_events(world.job.job_id))[1:]
    assert json.loads(event.payload_json) == {"round": 1, "num_results": 2, "metrics": {"loss": 0.5}}
    assert (await world.store.get_run(world.run.run_id)).round == 1


@pytest.mark.parametrize(
    ("kind", "payload", "message"),
    [
        ("round_ended", {"num_results": 1}, "unknown event kind 'round_ended'"),
        ("round_closed", {"num_results": 1, "loss": 0.5}, "a round_closed event has num_results, metrics"),
    ],
)
async def test_a_bad_event_is_refused_before_anything_is_written(
    world: World, kind: str, payload: Mapping[str, Any], message: str
) -> None:
    heard: list[tuple[str, int]] = []
    ctx = context(world, heard)
    with pytest.raises(InvalidArgument, match=message):
        await ctx.checkpoint(1, model(1.0), events=[(kind, 1, payload)])
    with pytest.raises(InvalidArgument, match=message):
        await ctx.emit(kind, 1, payload)
    assert await world.store.list_checkpoints(world.run.run_id) == []
    assert await kinds(world.store, world.job.job_id) == []
    assert heard == []


async def test_a_driver_that_lost_its_run_records_no_event(world: World) -> None:
    heard: list[tuple[str, int]] = []
    ctx = context(world, heard)
    later = world.clock.advance(timedelta(minutes=5))  # past the lease: another coordinator takes it
    await world.store.acquire_run_lease(
        world.run.run_id, owner="coordinator-2", now=later, lease=timedelta(seconds=30)
    )
    with pytest.raises(RunLeaseLost):
        await ctx.emit("round_started", 1, {"num_devices": 2})
    closed = ("round_closed", 1, {"num_results": 2, "metrics": {}})
    with pytest.raises(RunLeaseLost):
        await ctx.checkpoint(1, model(1.0), events=[closed])
    assert await kinds(world.store, world.job.job_id) == []
    assert heard == []
    run = await world.store.get_run(world.run.run_id)
    assert (run.state, run.round, run.owner) == (RunState.RUNNING, 0, "coordinator-2")
