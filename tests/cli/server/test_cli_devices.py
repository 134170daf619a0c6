"""``fedlink device list|revoke`` against a real coordinator with stub-only devices."""

from __future__ import annotations

import json

import grpc
import pytest

from .conftest import Cli, CoordinatorThread, StubDevice


def _enroll(coordinator: CoordinatorThread, platforms: list[str]) -> list[str]:
    async def enroll() -> list[str]:
        async with grpc.aio.insecure_channel(coordinator.address) as channel:
            return [(await StubDevice(channel).enroll({"platform": p})).device_id for p in platforms]

    return coordinator.submit(enroll()).result(timeout=30)


def _get_job_code(coordinator: CoordinatorThread, enrolled: StubDevice) -> grpc.StatusCode:
    """The status of a GetJob call with the enrolled device's credential, on a fresh channel."""

    async def call() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(coordinator.address) as channel:
            device = StubDevice(channel)
            device.metadata = enrolled.metadata
            try:
                await device.get_job()
            except grpc.aio.AioRpcError as exc:
                return exc.code()
            return grpc.StatusCode.OK

    return coordinator.submit(call()).result(timeout=30)


def test_list_shows_enrolled_devices_in_both_formats(cli: Cli, coordinator: CoordinatorThread) -> None:
    ids = _enroll(coordinator, ["linux", "android"])

    listed = cli("device", "list", "--format", "json")
    assert listed.exit_code == 0, listed.output
    devices = json.loads(listed.stdout)
    assert {d["device_id"]: d["device_info"]["platform"] for d in devices} == dict(
        zip(ids, ["linux", "android"], strict=True)
    )
    assert all(d["state"] == "ONLINE" and d["enroll_time"].endswith("Z") for d in devices)

    table = cli("device", "list")
    assert table.exit_code == 0, table.output
    header, *rows = table.stdout.splitlines()
    assert header.split()[:3] == ["DEVICE", "ID", "STATE"]
    assert sorted(row.split()[:3] for row in rows) == sorted(
        [[ids[0], "ONLINE", "linux"], [ids[1], "ONLINE", "android"]]
    )


def test_revoke_refuses_the_device_from_then_on(cli: Cli, coordinator: CoordinatorThread) -> None:
    async def enroll() -> StubDevice:
        async with grpc.aio.insecure_channel(coordinator.address) as channel:
            return await StubDevice(channel).enroll()

    device = coordinator.submit(enroll()).result(timeout=30)
    assert _get_job_code(coordinator, device) == grpc.StatusCode.OK

    revoked = cli("device", "revoke", device.device_id)
    assert revoked.exit_code == 0, revoked.output
    assert revoked.stdout.strip() == f"device {device.device_id} REVOKED"
    assert _get_job_code(coordinator, device) == grpc.StatusCode.UNAUTHENTICATED

    only_revoked = json.loads(cli("device", "list", "--state", "revoked", "--format", "json").stdout)
    assert [d["device_id"] for d in only_revoked] == [device.device_id]
    assert json.loads(cli("device", "list", "--state", "online", "--format", "json").stdout) == []


@pytest.mark.parametrize("device_id", ["no-such-device"])
def test_revoking_an_unknown_device_is_not_found(cli: Cli, device_id: str) -> None:
    result = cli("device", "revoke", device_id)
    assert result.exit_code == 1
    assert result.stderr.startswith("error: NOT_FOUND: ")
    assert "Traceback" not in result.output


def test_an_empty_list_says_so(cli: Cli) -> None:
    result = cli("device", "list")
    assert (result.exit_code, result.stdout.strip()) == (0, "(none)")
