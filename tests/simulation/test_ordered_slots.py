"""OrderedSlots: the in-process transport's in-flight slots go to the lowest waiting device index."""

from __future__ import annotations

import asyncio

from fedlink.simulation.transport import OrderedSlots


async def test_waiters_are_served_lowest_priority_first_and_fifo_among_equals() -> None:
    slots = OrderedSlots(1)
    await slots.acquire(50)  # the one slot, taken at once
    served: list[str] = []

    async def wait(priority: int, name: str) -> None:
        await slots.acquire(priority)
        served.append(name)

    waiters = [
        asyncio.create_task(wait(p, n))
        for p, n in [(9, "nine"), (3, "three-a"), (7, "seven"), (3, "three-b")]
    ]
    await asyncio.sleep(0)
    assert served == []
    for _ in waiters:
        slots.release()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    await asyncio.gather(*waiters)
    assert served == ["three-a", "three-b", "seven", "nine"]


async def test_a_cancelled_waiter_does_not_swallow_a_slot() -> None:
    slots = OrderedSlots(1)
    await slots.acquire(0)
    early = asyncio.create_task(slots.acquire(1))
    late = asyncio.create_task(slots.acquire(2))
    await asyncio.sleep(0)
    early.cancel()  # cancelled while waiting: skipped when the slot comes back
    await asyncio.sleep(0)
    slots.release()
    await asyncio.wait_for(late, 1.0)

    # Granted and cancelled before it resumed: the slot is passed on, not lost.
    granted = asyncio.create_task(slots.acquire(1))
    after = asyncio.create_task(slots.acquire(5))
    await asyncio.sleep(0)
    slots.release()  # to ``granted``
    granted.cancel()  # before it ran again
    await asyncio.gather(granted, return_exceptions=True)
    await asyncio.wait_for(after, 1.0)
    slots.release()
    await asyncio.wait_for(slots.acquire(9), 1.0)  # one slot, free again
