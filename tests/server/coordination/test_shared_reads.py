"""SharedReads: one read for concurrent askers, answers kept up to the size, failures not kept."""

from __future__ import annotations

import asyncio

import pytest

from fedlink.server.coordination.shared_reads import SharedReads


async def test_concurrent_askers_share_one_read_and_later_ones_reuse_it() -> None:
    calls: list[str] = []
    gate = asyncio.Event()

    async def read(key: str) -> str:
        calls.append(key)
        await gate.wait()
        return key.upper()

    shared = SharedReads(read, size=2)
    askers = [asyncio.ensure_future(shared.get("a")) for _ in range(5)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*askers) == ["A"] * 5
    assert await shared.get("a") == "A"
    assert calls == ["a"]


async def test_least_recently_used_answer_goes_first() -> None:
    calls: list[str] = []

    async def read(key: str) -> str:
        calls.append(key)
        return key

    shared = SharedReads(read, size=2)
    for key in ["a", "b", "a", "c", "a", "b"]:
        await shared.get(key)
    # "b" was the least recently used when "c" came in, so only it is read again.
    assert calls == ["a", "b", "c", "b"]


async def test_a_failed_read_is_not_kept() -> None:
    attempts = 0

    async def read(key: str) -> str:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise OSError("disk hiccup")
        return key

    shared = SharedReads(read, size=2)
    with pytest.raises(OSError, match="disk hiccup"):
        await shared.get("a")
    assert await shared.get("a") == "a"
    assert attempts == 2


async def test_one_cancelled_asker_does_not_cancel_the_read_for_the_others() -> None:
    gate = asyncio.Event()

    async def read(key: str) -> str:
        await gate.wait()
        return key

    shared = SharedReads(read, size=2)
    first = asyncio.ensure_future(shared.get("a"))
    second = asyncio.ensure_future(shared.get("a"))
    await asyncio.sleep(0)
    first.cancel()
    gate.set()
    assert await second == "a"
    assert first.cancelled()


async def test_the_read_runs_in_an_askers_task_and_a_waiter_takes_over_when_it_is_cancelled() -> None:
    started: list[asyncio.Task[object] | None] = []
    gate = asyncio.Event()

    async def read(key: str) -> str:
        started.append(asyncio.current_task())
        await gate.wait()
        return key.upper()

    shared = SharedReads(read, size=2)
    first = asyncio.ensure_future(shared.get("a"))
    second = asyncio.ensure_future(shared.get("a"))
    await asyncio.sleep(0)
    assert started == [first]  # no task of its own: nothing is left running once the askers are gone
    first.cancel()
    for _ in range(10):  # the cancellation reaches the waiter a few loop turns later
        await asyncio.sleep(0)
    assert started == [first, second]  # the waiter read it again, in its own task
    gate.set()
    assert await second == "A"
    assert first.cancelled()
    assert await shared.get("a") == "A" and len(started) == 2  # and the answer is kept


async def test_a_cancelled_lone_asker_leaves_no_task_and_no_answer_behind() -> None:
    async def read(key: str) -> str:
        await asyncio.sleep(3600)
        return key

    shared = SharedReads(read, size=2)
    asker = asyncio.ensure_future(shared.get("a"))
    await asyncio.sleep(0)
    asker.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asker
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_a_failed_read_fails_its_waiters_too_and_is_not_kept() -> None:
    gate = asyncio.Event()
    attempts = 0

    async def read(key: str) -> str:
        nonlocal attempts
        attempts += 1
        await gate.wait()
        if attempts == 1:
            raise OSError("disk hiccup")
        return key

    shared = SharedReads(read, size=2)
    askers = [asyncio.ensure_future(shared.get("a")) for _ in range(3)]
    await asyncio.sleep(0)
    gate.set()
    outcomes = await asyncio.gather(*askers, return_exceptions=True)
    assert all(isinstance(o, OSError) for o in outcomes) and attempts == 1
    assert await shared.get("a") == "a" and attempts == 2
