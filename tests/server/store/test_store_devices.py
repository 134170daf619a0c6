"""Contract: device enrollment, authentication by credential hash, presence, revocation, listing."""

from __future__ import annotations

from datetime import timedelta

import pytest

from fedlink.common.errors import AlreadyExists, IllegalTransition, NotFound, Unauthenticated
from fedlink.server.domain import DeviceState, ManualClock
from fedlink.server.store import SqlStateStore


async def test_enroll_and_authenticate(store: SqlStateStore, clock: ManualClock) -> None:
    device = await store.enroll_device({"os": "android", "app": "1.2"}, {"user": "u1"}, "hash-1")
    assert device.state is DeviceState.ONLINE and device.last_seen == clock.now()
    assert await store.authenticate_device("hash-1") == device
    assert await store.get_device(device.device_id) == device
    with pytest.raises(Unauthenticated):
        await store.authenticate_device("hash-unknown")
    with pytest.raises(AlreadyExists):
        await store.enroll_device({}, {}, "hash-1")
    with pytest.raises(NotFound):
        await store.get_device("0" * 32)


async def test_presence_offline_and_back(store: SqlStateStore, clock: ManualClock) -> None:
    old = await store.enroll_device({}, {}, "h-old")
    fresh_time = clock.advance(timedelta(minutes=10))
    fresh = await store.enroll_device({}, {}, "h-fresh")
    assert await store.mark_offline(older_than=fresh_time - timedelta(minutes=5)) == 1
    assert (await store.get_device(old.device_id)).state is DeviceState.OFFLINE
    assert (await store.get_device(fresh.device_id)).state is DeviceState.ONLINE
    seen = clock.advance(timedelta(seconds=1))
    await store.touch_devices([old.device_id, fresh.device_id], seen)
    back = await store.get_device(old.device_id)
    assert (back.state, back.last_seen) == (DeviceState.ONLINE, seen)


async def test_revoked_device_cannot_authenticate_or_come_back(
    store: SqlStateStore, clock: ManualClock
) -> None:
    device = await store.enroll_device({}, {}, "h")
    revoked = await store.revoke_device(device.device_id)
    assert revoked.state is DeviceState.REVOKED
    with pytest.raises(Unauthenticated, match="revoked"):
        await store.authenticate_device("h")
    await store.touch_devices([device.device_id], clock.now())
    assert (await store.get_device(device.device_id)).state is DeviceState.REVOKED
    with pytest.raises(IllegalTransition):
        await store.revoke_device(device.device_id)


async def test_list_devices_pages_and_filters(store: SqlStateStore, clock: ManualClock) -> None:
    made = []
    for i in range(5):
        made.append(await store.enroll_device({"n": str(i)}, {}, f"h{i}"))
        clock.advance(timedelta(seconds=1))
    await store.revoke_device(made[1].device_id)
    seen: list[str] = []
    token = ""
    while True:
        page = await store.list_devices(page_size=2, page_token=token)
        seen.extend(d.device_id for d in page.items)
        if not (token := page.next_page_token):
            break
    assert seen == [d.device_id for d in reversed(made)]
    revoked = await store.list_devices(state=DeviceState.REVOKED)
    assert [d.device_id for d in revoked.items] == [made[1].device_id]


async def test_authenticate_many_answers_each_hash_in_order(store: SqlStateStore) -> None:
    a = await store.enroll_device({"n": "a"}, {}, "h-a")
    b = await store.enroll_device({"n": "b"}, {}, "h-b")
    await store.revoke_device(b.device_id)
    assert await store.authenticate_devices([]) == []
    answers = await store.authenticate_devices(["h-a", "h-unknown", "h-b", "h-a"])
    assert answers[0] == answers[3] == a == await store.authenticate_device("h-a")
    assert isinstance(answers[1], Unauthenticated) and "unknown" in answers[1].message
    assert isinstance(answers[2], Unauthenticated) and b.device_id in answers[2].message
    assert "revoked" in answers[2].message


async def test_online_devices_lists_ids_and_info_when_asked(store: SqlStateStore, clock: ManualClock) -> None:
    made = [await store.enroll_device({"os": f"os{i}"}, {"user": "u"}, f"h{i}") for i in range(4)]
    await store.revoke_device(made[1].device_id)
    clock.advance(timedelta(minutes=10))
    await store.touch_devices([made[0].device_id, made[3].device_id], clock.now())
    assert await store.mark_offline(older_than=clock.now() - timedelta(minutes=5)) == 1  # made[2]
    with_info = sorted(await store.online_devices(with_info=True))
    expected = sorted([made[0], made[3]], key=lambda d: d.device_id)
    assert with_info == [(d.device_id, d.device_info) for d in expected]
    without = sorted(await store.online_devices(with_info=False))
    assert without == [(d.device_id, {}) for d in expected]
