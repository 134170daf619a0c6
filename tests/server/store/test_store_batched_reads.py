"""Contract: the batched forms the simulation uses: has_claimable_many and enroll_devices."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from fedlink.common.errors import AlreadyExists, NotFound
from fedlink.server.domain import DeviceState, ManualClock
from fedlink.server.store import SqlStateStore
from fedlink.server.store.protocol import NewDevice
from fedlink.server.store.testing import World

LEASE = timedelta(seconds=30)


async def _agree(world: World, pairs: list[tuple[str, str]], now: datetime) -> list[bool]:
    """has_claimable_many's answer, checked against asking one by one."""
    many = await world.store.has_claimable_many(pairs, now)
    one_by_one = [await world.store.has_claimable(d, j, now) for d, j in pairs]
    assert many == one_by_one
    return many


async def test_has_claimable_many_agrees_with_one_by_one(world: World) -> None:
    store, job_id = world.store, world.job.job_id
    d0, d1, d2, d3 = (d.device_id for d in world.devices[:4])
    now = world.clock.now()
    pairs = [(d0, job_id), (d1, job_id), (d2, job_id), (d3, job_id), (d0, "no-such-job")]
    assert await _agree(world, pairs, now) == [False] * 5
    assert await store.has_claimable_many([], now) == []
    await world.tasks(1, targets=[d0])
    await world.tasks(1, targets=[d1, d2], slots=1)
    assert await _agree(world, pairs, now) == [True, True, True, False, False]
    held = await store.claim_task(d1, job_id, now, LEASE)
    assert held is not None
    # d1's lease is a re-delivery; d2's task has its one slot taken.
    assert await _agree(world, pairs, now) == [True, True, False, False, False]
    (shared,) = await world.tasks(1, slots=2)  # untargeted: everyone may take it
    assert await _agree(world, pairs, now) == [True, True, True, True, False]
    for device in (d2, d3):
        taken = await store.claim_task(device, job_id, now, LEASE)
        assert taken is not None and taken.task_id == shared.task_id
    # The untargeted task's slots are taken; d2 and d3 still hold their leases (re-delivery).
    assert await _agree(world, pairs, now) == [True, True, True, True, False]
    # A pair asked twice gets the same answer twice.
    assert await _agree(world, [(d0, job_id), (d0, job_id)], now) == [True, True]
    later = now + timedelta(minutes=20)
    assert await _agree(world, pairs, later) == [False] * 5  # past every deadline and lease


async def test_has_claimable_many_over_chunks(world: World) -> None:
    store, job_id = world.store, world.job.job_id
    devices = [d.device_id for d in world.devices]
    await world.tasks(1, targets=devices[::2])
    pairs = [(d, job_id) for d in devices] * 300  # more pairs than one chunk
    expected = [i % 2 == 0 for i in range(len(devices))] * 300
    assert await store.has_claimable_many(pairs, world.clock.now()) == expected


async def test_enroll_devices_in_one_go(store: SqlStateStore, clock: ManualClock) -> None:
    new = [
        NewDevice(device_id=f"sim-{i:03d}", credential_hash=f"hash-{i}", device_info={"i": str(i)})
        for i in range(1200)
    ]
    enrolled = await store.enroll_devices(new)
    assert [d.device_id for d in enrolled] == [n.device_id for n in new]
    assert enrolled[7].device_info == {"i": "7"} and enrolled[7].state is DeviceState.ONLINE
    assert enrolled[7].enrolled_at == clock.now()
    assert await store.authenticate_device("hash-1199") == enrolled[-1]
    assert await store.get_device("sim-042") == enrolled[42]
    fresh = await store.enroll_devices([NewDevice(credential_hash="hash-fresh")])
    assert len(fresh[0].device_id) > 8 and await store.authenticate_device("hash-fresh") == fresh[0]
    assert await store.enroll_devices([]) == []


@pytest.mark.parametrize(
    "clash",
    [
        NewDevice(device_id="sim-000", credential_hash="hash-other"),  # the id is taken
        NewDevice(device_id="sim-new", credential_hash="hash-0"),  # the credential is taken
        NewDevice(device_id="sim-b", credential_hash="hash-b2"),  # the id is given twice
    ],
)
async def test_enroll_devices_is_all_or_none(store: SqlStateStore, clash: NewDevice) -> None:
    await store.enroll_devices([NewDevice(device_id="sim-000", credential_hash="hash-0")])
    batch = [
        NewDevice(device_id="sim-a", credential_hash="hash-a"),
        NewDevice(device_id="sim-b", credential_hash="hash-b"),
        clash,
    ]
    with pytest.raises(AlreadyExists):
        await store.enroll_devices(batch)
    for device_id in ("sim-a", "sim-b", "sim-new"):
        with pytest.raises(NotFound):
            await store.get_device(device_id)
