"""SharedReads: one read for concurrent askers, answers kept up to the size, failures not kept."""

from __future__ import annotations

import asyncio

import pytest

from fedlink.server.protocol.shared import SharedReads


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
