"""The batcher coalesces concurrent requests and routes each outcome to its own caller."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from fedlink.server.protocol.batching import Batcher


async def test_concurrent_requests_share_batches_and_get_their_own_replies() -> None:
    batches: list[list[int]] = []

    async def handler(requests: Sequence[int]) -> list[int | BaseException]:
        batches.append(list(requests))
        await asyncio.sleep(0.01)  # while this batch is written, others queue up
        return [r * 2 if r % 7 else ValueError(f"bad {r}") for r in requests]

    batcher: Batcher[int, int] = Batcher(handler, max_batch=50)
    results = await asyncio.gather(*(batcher.submit(i) for i in range(1, 201)), return_exceptions=True)
    for i, result in zip(range(1, 201), results, strict=True):
        if i % 7:
            assert result == i * 2
        else:
            assert isinstance(result, ValueError) and str(result) == f"bad {i}"
    assert sorted(r for b in batches for r in b) == list(range(1, 201))
    assert len(batches) < 20, "concurrent requests should be coalesced"
    assert max(len(b) for b in batches) <= 50


async def test_a_failing_handler_fails_only_its_batch() -> None:
    calls = 0

    async def handler(requests: Sequence[int]) -> list[int | BaseException]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("store down")
        return list(requests)

    batcher: Batcher[int, int] = Batcher(handler)
    with pytest.raises(RuntimeError, match="store down"):
        await batcher.submit(1)
    assert await batcher.submit(2) == 2


async def test_a_cancelled_caller_does_not_cancel_the_batch() -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def handler(requests: Sequence[int]) -> list[int | BaseException]:
        started.set()
        await release.wait()
        return list(requests)

    batcher: Batcher[int, int] = Batcher(handler)
    first = asyncio.create_task(batcher.submit(1))
    await started.wait()
    second = asyncio.create_task(batcher.submit(2))
    await asyncio.sleep(0)
    first.cancel()
    release.set()
    assert await second == 2
    with pytest.raises(asyncio.CancelledError):
        await first


async def _batches_of_staggered_requests(linger: float) -> list[list[int]]:
    batches: list[list[int]] = []

    async def handler(requests: Sequence[int]) -> list[int | BaseException]:
        batches.append(list(requests))
        await asyncio.sleep(0.005)  # a store read: requests queue up meanwhile
        return list(requests)

    batcher: Batcher[int, int] = Batcher(handler, linger=linger)

    async def staggered(i: int) -> int:
        await asyncio.sleep(0.001 * i)  # callers arrive over ~80 ms, not all at once
        return await batcher.submit(i)

    assert await asyncio.gather(*(staggered(i) for i in range(80))) == list(range(80))
    assert sorted(r for b in batches for r in b) == list(range(80))
    return batches


async def test_linger_grows_the_batches_of_requests_that_arrive_together() -> None:
    plain = await _batches_of_staggered_requests(linger=0.0)
    lingering = await _batches_of_staggered_requests(linger=0.03)
    assert len(lingering) * 2 <= len(plain), f"{len(lingering)} batches with linger, {len(plain)} without"


async def test_linger_does_not_delay_a_lone_request() -> None:
    async def handler(requests: Sequence[int]) -> list[int | BaseException]:
        return list(requests)

    batcher: Batcher[int, int] = Batcher(handler, linger=0.5)
    loop = asyncio.get_running_loop()
    for i in range(3):
        started = loop.time()
        assert await batcher.submit(i) == i
        assert loop.time() - started < 0.25, "a lone request waited for company"
