"""Contract: what devices asked for, sign-offs, leases that keep a device online, approval, the cap.

Run on every backend (SQLite memory and file, PostgreSQL): sampling reads these, so a backend that
kept a silent or signed-off device eligible would hand rounds to devices that never take them.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from fedlink.common.errors import IllegalTransition, NotFound, ResourceExhausted, Unauthenticated
from fedlink.server.domain import AssignmentState, DeviceState, ManualClock
from fedlink.server.store import ClaimRequest, SqlStateStore
from fedlink.server.store.protocol import NewDevice
from fedlink.server.store.testing import StoreFactory, World

LEASE = timedelta(minutes=5)


async def online_ids(store: SqlStateStore, job_name: str | None = None) -> set[str]:
    return {device_id for device_id, _ in await store.online_devices(with_info=False, job_name=job_name)}


async def test_a_job_samples_only_devices_that_asked_for_its_name_or_any_job(
    store: SqlStateStore, clock: ManualClock
) -> None:
    anything, mnist, other, silent = [await store.enroll_device({}, {}, f"h{i}") for i in range(4)]
    await store.record_polls(
        [(anything.device_id, ""), (mnist.device_id, "mnist"), (other.device_id, "other")], clock.now()
    )
    assert await online_ids(store, "mnist") == {anything.device_id, mnist.device_id}
    assert await online_ids(store, "other") == {anything.device_id, other.device_id}
    # Without a job name, every ONLINE device, the silent one included (what ListDevices shows).
    assert await online_ids(store) == {d.device_id for d in (anything, mnist, other, silent)}
    # What a device asks for last is what counts.
    await store.record_polls([(mnist.device_id, "other")], clock.now())
    assert await online_ids(store, "mnist") == {anything.device_id}


async def test_devices_enrolled_with_what_they_will_ask_for_are_eligible_at_once(
    store: SqlStateStore,
) -> None:
    made = await store.enroll_devices(
        [NewDevice(credential_hash="b1", polled_job_name="sim"), NewDevice(credential_hash="b2")]
    )
    assert await online_ids(store, "sim") == {made[0].device_id}


async def test_a_poll_brings_an_offline_device_back_and_is_seen(
    store: SqlStateStore, clock: ManualClock
) -> None:
    device = await store.enroll_device({}, {}, "h")
    later = clock.advance(timedelta(minutes=10))
    assert await store.mark_offline(older_than=later - timedelta(minutes=1)) == 1
    await store.record_polls([(device.device_id, "")], later)
    back = await store.get_device(device.device_id)
    assert (back.state, back.last_seen) == (DeviceState.ONLINE, later)
    assert await online_ids(store, "any name") == {device.device_id}


async def test_sign_off_takes_a_device_offline_and_releases_what_it_holds(world: World) -> None:
    store, clock = world.store, world.clock
    leaving, staying = world.devices[0], world.devices[1]
    await store.record_polls([(d.device_id, "") for d in world.devices], clock.now())
    await world.tasks(2)
    held = [
        await store.claim_task(d.device_id, world.job.job_id, clock.now(), LEASE) for d in (leaving, staying)
    ]
    assert all(a is not None for a in held)
    released = await store.sign_off_device(leaving.device_id, clock.now())
    assert [a.assignment_id for a in released] == [held[0].assignment_id if held[0] else ""]
    assert (await store.get_assignment(released[0].assignment_id)).state is AssignmentState.RELEASED
    assert held[1] is not None
    assert (await store.get_assignment(held[1].assignment_id)).state is AssignmentState.LEASED
    assert (await store.get_device(leaving.device_id)).state is DeviceState.OFFLINE
    assert leaving.device_id not in await online_ids(store, world.job.name)
    assert staying.device_id in await online_ids(store, world.job.name)
    # Signing off again changes nothing.
    assert await store.sign_off_device(leaving.device_id, clock.now()) == []


async def test_calls_recorded_before_a_sign_off_do_not_bring_the_device_back(
    store: SqlStateStore, clock: ManualClock
) -> None:
    device = await store.enroll_device({}, {}, "h")
    batch_taken = clock.advance(timedelta(seconds=1))  # a batch of calls seen, written later
    signed_off = clock.advance(timedelta(seconds=1))
    await store.sign_off_device(device.device_id, signed_off)
    await store.touch_devices([device.device_id], batch_taken)
    assert (await store.get_device(device.device_id)).state is DeviceState.OFFLINE
    called_again = clock.advance(timedelta(seconds=1))
    await store.touch_devices([device.device_id], called_again)
    back = await store.get_device(device.device_id)
    assert (back.state, back.last_seen) == (DeviceState.ONLINE, called_again)


async def test_a_device_holding_a_lease_stays_online_while_it_trains(world: World) -> None:
    store, clock = world.store, world.clock
    busy, idle = world.devices[0], world.devices[1]
    await world.tasks(1, targets=[busy.device_id])
    assert await store.claim_task(busy.device_id, world.job.job_id, clock.now(), LEASE) is not None
    later = clock.advance(timedelta(minutes=2))  # training: no call but the lease renewals
    moved = await store.mark_offline(older_than=later - timedelta(seconds=45))
    assert moved == len(world.devices) - 1
    assert (await store.get_device(busy.device_id)).state is DeviceState.ONLINE
    assert (await store.get_device(idle.device_id)).state is DeviceState.OFFLINE


async def test_pending_devices_wait_for_approval(store: SqlStateStore, clock: ManualClock) -> None:
    device = await store.enroll_device({"os": "linux"}, {}, "h", pending=True)
    assert device.state is DeviceState.PENDING
    seen = clock.advance(timedelta(seconds=1))
    await store.touch_devices([device.device_id], seen)
    await store.record_polls([(device.device_id, "")], seen)
    assert (await store.get_device(device.device_id)).state is DeviceState.PENDING  # calls do not approve
    assert await online_ids(store) == set()
    assert await store.mark_offline(older_than=seen + timedelta(hours=1)) == 0
    listed = await store.list_devices(state=DeviceState.PENDING)
    assert [d.device_id for d in listed.items] == [device.device_id]
    approved = await store.approve_device(device.device_id)
    assert approved.state is DeviceState.ONLINE
    assert await online_ids(store, "any") == {device.device_id}
    assert await store.approve_device(device.device_id) == approved  # approved already: as it is
    await store.revoke_device(device.device_id)
    with pytest.raises(IllegalTransition):
        await store.approve_device(device.device_id)
    with pytest.raises(NotFound):
        await store.approve_device("0" * 32)
    refused = await store.enroll_device({}, {}, "h2", pending=True)
    assert (await store.revoke_device(refused.device_id)).state is DeviceState.REVOKED


async def test_the_device_cap_counts_devices_that_are_not_revoked(store: SqlStateStore) -> None:
    first = await store.enroll_device({}, {}, "h1", max_devices=2)
    await store.enroll_device({}, {}, "h2", max_devices=2, pending=True)  # pending ones count
    with pytest.raises(ResourceExhausted, match="cap of 2"):
        await store.enroll_device({}, {}, "h3", max_devices=2)
    with pytest.raises(Unauthenticated):  # the refused enrolment left nothing behind
        await store.authenticate_device("h3")
    await store.revoke_device(first.device_id)
    await store.enroll_device({}, {}, "h3", max_devices=2)


async def test_concurrent_enrolments_never_exceed_the_cap(
    store: SqlStateStore, more_stores: StoreFactory, backend: str
) -> None:
    # Separate engines (on PostgreSQL, concurrent transactions that each count before inserting).
    stores = [await more_stores() for _ in range(4)]
    outcomes = await asyncio.gather(
        *(s.enroll_device({}, {}, f"c{i}", max_devices=3) for i, s in enumerate(stores * 2)),
        return_exceptions=True,
    )
    enrolled = [o for o in outcomes if not isinstance(o, BaseException)]
    refused = [o for o in outcomes if isinstance(o, ResourceExhausted)]
    assert (len(enrolled), len(refused)) == (3, 5), (backend, outcomes)


async def test_the_enrolment_digest_is_kept_with_the_device(store: SqlStateStore) -> None:
    with_digest = await store.enroll_device({}, {}, "h1", enrolment_digest="d" * 64)
    without = await store.enroll_device({}, {}, "h2")
    assert await store.enrolment_digest(with_digest.device_id) == "d" * 64
    assert await store.enrolment_digest(without.device_id) is None
    with pytest.raises(NotFound):
        await store.enrolment_digest("0" * 32)


async def test_claims_still_serve_a_signed_off_device_that_asks_again(world: World) -> None:
    # Signing off is about sampling: a device that comes back and claims is served as before.
    store, clock = world.store, world.clock
    device = world.devices[0]
    await world.tasks(1, targets=[device.device_id])
    await store.sign_off_device(device.device_id, clock.now())
    claimed = await store.claim_tasks(
        [ClaimRequest(device_id=device.device_id, job_id=world.job.job_id)], clock.now(), LEASE
    )
    assert claimed[0] is not None
