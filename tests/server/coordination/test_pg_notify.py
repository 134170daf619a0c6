"""Long-poll wake-ups across replicas: two PgTaskNotifiers on one real PostgreSQL database.

A notification on one wakes the other's waiters (of the named devices only, or of the whole job when
the device list would not fit a NOTIFY payload); a notifier does not wake itself twice; a tick's
notifications share one round trip; the listener rides out ``pg_terminate_backend`` of its connection
and wakes its waiters once it listens again.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import asyncpg
import pytest

from fedlink.server.coordination.pg_notify import MAX_PAYLOAD_BYTES, PgTaskNotifier, encode, encode_progress
from fedlink.server.store.testing import asyncpg_dsn

pytestmark = pytest.mark.postgres

#: Far longer than a wake-up takes: a wait that returns True was woken, not timed out.
WAKE_S = 10.0


@pytest.fixture
async def pair(pg_database: str) -> AsyncIterator[tuple[PgTaskNotifier, PgTaskNotifier]]:
    """Replicas A and B: two notifiers listening on one database."""
    async with (
        PgTaskNotifier(pg_database, replica="a") as a,
        PgTaskNotifier(pg_database, replica="b", reconnect_delay=0.05) as b,
    ):
        assert a.listening and b.listening, "a notifier did not listen within its connect timeout"
        yield a, b


async def terminate(url: str, pid: int) -> None:
    """Ends a backend as an operator's ``pg_terminate_backend`` (or a failover) would."""
    conn = await asyncpg.connect(asyncpg_dsn(url), timeout=5)
    try:
        assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid) is True
    finally:
        await conn.close()


async def until(what: str, check: Callable[[], bool], bound_s: float = WAKE_S) -> None:
    """Waits until ``check()`` is true; fails the test, naming ``what``, after ``bound_s``."""
    for _ in range(int(bound_s / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what}: not within {bound_s}s")


def test_a_device_list_too_long_for_a_notify_payload_becomes_the_whole_job() -> None:
    few = json.loads(encode("r", "job", ["d1", "d2"]))
    assert few == {"replica": "r", "job": "job", "devices": ["d1", "d2"]}
    many = [f"device-{i:05d}-{'x' * 30}" for i in range(400)]
    assert len(json.dumps(many)) > MAX_PAYLOAD_BYTES
    assert json.loads(encode("r", "job", many)) == {"replica": "r", "job": "job"}
    assert json.loads(encode("r", "job", None)) == {"replica": "r", "job": "job"}


async def test_a_notification_on_one_replica_wakes_a_waiter_on_the_other(
    pair: tuple[PgTaskNotifier, PgTaskNotifier],
) -> None:
    a, b = pair
    waiting = asyncio.create_task(b.waiter("job", "d1").wait(WAKE_S))
    await asyncio.sleep(0)
    a.notify("job", ["d1"])
    assert await waiting is True
    # The whole job (devices=None) wakes every device of it, and nothing of another job.
    everyone = [asyncio.create_task(b.waiter("job", d).wait(WAKE_S)) for d in ("d1", "d2")]
    elsewhere = b.waiter("other-job", "d1")
    await asyncio.sleep(0)
    a.notify("job")
    assert await asyncio.gather(*everyone) == [True, True]
    assert await elsewhere.wait(0) is False


async def test_a_notification_for_some_devices_wakes_only_those(
    pair: tuple[PgTaskNotifier, PgTaskNotifier],
) -> None:
    a, b = pair
    chosen = asyncio.create_task(b.waiter("job", "d1").wait(WAKE_S))
    passed_over = b.waiter("job", "d2")
    marker = asyncio.create_task(b.waiter("marker", "d").wait(WAKE_S))
    await asyncio.sleep(0)
    a.notify("job", ["d1", "d3"])
    await asyncio.sleep(0.05)
    a.notify("marker")  # published after the first: once B heard it, B has heard the first too
    assert await chosen is True
    assert await marker is True
    assert await passed_over.wait(0) is False


async def test_an_oversized_device_list_wakes_the_whole_job_on_the_other_replica(
    pair: tuple[PgTaskNotifier, PgTaskNotifier],
) -> None:
    a, b = pair
    outsider = asyncio.create_task(b.waiter("job", "not-in-the-list").wait(WAKE_S))
    await asyncio.sleep(0)
    a.notify("job", [f"device-{i:05d}-{'x' * 30}" for i in range(400)])  # ~16 kB of ids
    assert await outsider is True
    assert a.listening  # the publish did not break A's connection (an over-long payload would)


async def test_a_replica_does_not_wake_itself_with_its_own_notification(
    pair: tuple[PgTaskNotifier, PgTaskNotifier],
) -> None:
    a, b = pair
    on_b = asyncio.create_task(b.waiter("job", "d1").wait(WAKE_S))
    await asyncio.sleep(0)
    a.notify("job", ["d1"])
    after = a.waiter("job", "d1")  # taken after A's local wake-up: only an echo could wake it
    assert await on_b is True
    await until("A published", lambda: a.publishes >= 1)
    await asyncio.sleep(0.1)  # PostgreSQL sends a session its own notifications before its reply
    assert await after.wait(0) is False
    assert a.received == 0


async def test_the_notifications_of_one_tick_go_out_in_one_round_trip(
    pair: tuple[PgTaskNotifier, PgTaskNotifier],
) -> None:
    a, b = pair
    jobs = [f"job-{i}" for i in range(200)]
    waits = [asyncio.create_task(b.waiter(job, "d").wait(WAKE_S)) for job in jobs]
    await asyncio.sleep(0)
    before = a.publishes
    for job in jobs:
        a.notify(job, ["d"])
        a.notify(job, ["d", "e"])  # merged with the first: one notification per job
    assert await asyncio.gather(*waits) == [True] * len(jobs)
    await until("A's round trip returned", lambda: a.publishes > before)  # B may hear before A's reply
    await asyncio.sleep(0.1)  # a second round trip, had there been one, would have been made by now
    assert a.publishes - before == 1, f"{a.publishes - before} round trips for one tick's notifications"
    assert b.received == len(jobs)


async def test_the_listener_survives_pg_terminate_backend_and_wakes_its_waiters_when_back(
    pg_database: str, pair: tuple[PgTaskNotifier, PgTaskNotifier]
) -> None:
    a, b = pair
    old_pid = b.listener_pid
    assert old_pid is not None
    # A notification B may miss while it is away: its waiters are woken once it listens again.
    waiting = asyncio.create_task(b.waiter("job", "d1").wait(WAKE_S))
    await asyncio.sleep(0)
    await terminate(pg_database, old_pid)
    assert await waiting is True
    await until("B listens again", lambda: b.listening and b.listener_pid != old_pid)
    assert b.reconnects == 1
    # And it hears the other replica again on its new connection.
    again = asyncio.create_task(b.waiter("job", "d1").wait(WAKE_S))
    await asyncio.sleep(0)
    a.notify("job", ["d1"])
    assert await again is True


async def test_what_a_replica_publishes_while_its_connection_is_gone_is_sent_when_it_is_back(
    pg_database: str, pair: tuple[PgTaskNotifier, PgTaskNotifier]
) -> None:
    a, b = pair
    old_pid = a.listener_pid
    assert old_pid is not None
    await terminate(pg_database, old_pid)
    await until("A noticed", lambda: not a.listening or a.listener_pid != old_pid)
    waiting = asyncio.create_task(b.waiter("job", "d1").wait(WAKE_S))
    await asyncio.sleep(0)
    a.notify("job", ["d1"])  # while A reconnects (or on its new connection): kept until sent
    assert await waiting is True
    assert a.reconnects == 1


async def test_an_application_name_in_the_url_names_the_store_and_listener_connections(
    pg_database: str,
) -> None:
    """How an operator tells replicas apart in ``pg_stat_activity`` (and terminates one's connections):
    ``?application_name=`` in the URL, which asyncpg.connect itself would refuse as an argument."""
    from fedlink.server.store.dialect import create_engine

    url = f"{pg_database}{'&' if '?' in pg_database else '?'}application_name=replica-7"
    engine = create_engine(url)
    try:
        async with PgTaskNotifier(url, replica="r7") as notifier, engine.connect() as conn:
            assert notifier.listening
            names = await conn.exec_driver_sql(
                "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"
            )
            seen = sorted(str(row[0]) for row in names)
    finally:
        await engine.dispose()
    assert "replica-7" in seen and "replica-7-notify" in seen, seen


def test_relayed_reports_are_split_over_as_many_payloads_as_they_need() -> None:
    assert [json.loads(p) for p in encode_progress("r", "job", [], True)] == [
        {"replica": "r", "job": "job", "urgent": True, "reported": []}
    ]
    ids = [f"{i:032x}" for i in range(1000)]  # task ids are 32 hex characters
    payloads = encode_progress("r", "job", ids, False)
    assert len(payloads) > 1 and all(len(p) <= MAX_PAYLOAD_BYTES for p in payloads)
    messages = [json.loads(p) for p in payloads]
    assert [t for m in messages for t in m["reported"]] == sorted(ids)  # each once, none lost
    assert {(m["replica"], m["job"], m["urgent"]) for m in messages} == {("r", "job", False)}


async def test_reports_recorded_on_one_replica_are_relayed_to_the_other(
    pair: tuple[PgTaskNotifier, PgTaskNotifier],
) -> None:
    a, b = pair
    heard: list[tuple[str, list[str], bool]] = []
    a.on_progress = lambda job, tasks, urgent: heard.append((job, list(tasks), urgent))
    b.on_progress = lambda job, tasks, urgent: pytest.fail(f"B heard its own relay: {job} {tasks}")
    many = [f"{i:032x}" for i in range(1000)]
    for task_id in many:  # one tick: merged per job, then split over payloads
        b.relay_progress("job", task_id, False)
    b.relay_progress("other", None, True)  # an expiry: no task, urgent
    # A task notification after the relays: once A heard it, it has heard them (one channel, in order).
    marker = asyncio.create_task(a.waiter("marker", "d").wait(WAKE_S))
    await asyncio.sleep(0.05)
    b.notify("marker")
    assert await marker is True
    reported = sorted(t for job, tasks, _ in heard if job == "job" for t in tasks)
    assert reported == many
    assert all(urgent is False for job, _, urgent in heard if job == "job")
    assert ("other", [], True) in heard
    assert b.received == 0
