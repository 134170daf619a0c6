"""Background loops wait out an unreachable store, however long it stays away, instead of giving up and
stopping the coordinator (its health says NOT_SERVING meanwhile); other failures still give up."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from fedlink.server.services.loops import BackgroundLoops, Loop, LoopGaveUp, LoopPolicy
from fedlink.server.store import StoreUnavailable
from fedlink.server.store.outages import is_store_away

POLICY = LoopPolicy(
    first_backoff=timedelta(milliseconds=5),
    max_backoff=timedelta(milliseconds=20),
    give_up_after=timedelta(milliseconds=100),
    ride_out=is_store_away,
    ride_out_every=timedelta(milliseconds=20),
)


async def _pause() -> None:
    await asyncio.sleep(0)


async def test_a_store_outage_longer_than_give_up_after_is_waited_out() -> None:
    away = asyncio.Event()
    away.set()
    steps: list[str] = []

    async def step() -> None:
        steps.append("away" if away.is_set() else "back")
        if away.is_set():
            raise StoreUnavailable("the database is unavailable", retry_after=timedelta(seconds=2))

    loops = BackgroundLoops(POLICY)
    loops.add(Loop(name="scan", step=step, pause=_pause))
    running = asyncio.create_task(loops.run())
    await asyncio.sleep(0.5)  # five times give_up_after
    assert not running.done(), "the loop gave up on a store outage"
    assert steps.count("away") >= 5  # tried again and again, at most ride_out_every apart
    away.clear()
    while "back" not in steps:  # noqa: ASYNC110 - the loop under test has no event to offer
        await asyncio.sleep(0.01)
    assert loops.loops[0].failures == 0
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running


async def test_a_failure_that_is_no_outage_still_gives_up() -> None:
    async def step() -> None:
        raise RuntimeError("a bug, not an outage")

    loops = BackgroundLoops(POLICY)
    loops.add(Loop(name="buggy", step=step, pause=_pause))
    with pytest.raises(LoopGaveUp, match="RuntimeError: a bug"):
        await asyncio.wait_for(loops.run(), 10)
