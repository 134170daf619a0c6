"""Long-poll wake-ups: a notification between taking a waiter and waiting is not lost."""

from __future__ import annotations

import asyncio

from fedlink.server.coordination.notify import LocalTaskNotifier


async def test_a_notification_wakes_waiters_of_that_job_only() -> None:
    notifier = LocalTaskNotifier()
    a = asyncio.create_task(notifier.waiter("job-a", "d1").wait(5))
    b = asyncio.create_task(notifier.waiter("job-b", "d1").wait(0.05))
    await asyncio.sleep(0)
    notifier.notify("job-a")
    assert await a is True
    assert await b is False


async def test_a_notification_before_the_wait_is_not_lost() -> None:
    notifier = LocalTaskNotifier()
    waiter = notifier.waiter("job", "d1")
    notifier.notify("job")  # lands after the waiter was taken, before wait() is called
    assert await waiter.wait(0.01) is True
    assert await notifier.waiter("job", "d1").wait(0.01) is False  # a fresh waiter waits for the next one


async def test_notify_all_wakes_everyone() -> None:
    notifier = LocalTaskNotifier()
    waits = [asyncio.create_task(notifier.waiter(f"job-{i}", "d").wait(5)) for i in range(3)]
    await asyncio.sleep(0)
    notifier.notify_all()
    assert await asyncio.gather(*waits) == [True, True, True]


async def test_a_task_for_one_device_wakes_that_device_only() -> None:
    notifier = LocalTaskNotifier()
    mine = asyncio.create_task(notifier.waiter("job", "d1").wait(5))
    other = asyncio.create_task(notifier.waiter("job", "d2").wait(0.05))
    await asyncio.sleep(0)
    notifier.notify("job", ["d1", "d3"])
    assert await mine is True
    assert await other is False
    everyone = [asyncio.create_task(notifier.waiter("job", d).wait(5)) for d in ("d1", "d2")]
    await asyncio.sleep(0)
    notifier.notify("job")
    assert await asyncio.gather(*everyone) == [True, True]
