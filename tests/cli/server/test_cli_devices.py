"""``fedlink device list|approve|revoke`` against a real coordinator with stub-only devices."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import Cli, CoordinatorThread, StubDevice, cli_for, plaintext_settings


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


@pytest.fixture
def approving(tmp_path: Path) -> Iterator[CoordinatorThread]:
    """A coordinator that requires an operator's approval of new devices."""
    settings = dataclasses.replace(plaintext_settings(tmp_path / "data"), require_approval=True)
    with CoordinatorThread(settings) as running:
        yield running


def test_approve_lets_a_pending_device_take_part(approving: CoordinatorThread) -> None:
    cli = cli_for(approving)

    async def enroll_and_ask() -> tuple[StubDevice, rpb.GetJobResponse]:
        async with grpc.aio.insecure_channel(approving.address) as channel:
            device = await StubDevice(channel).enroll()
            return device, await device.get_job()

    async def ask(enrolled: StubDevice) -> rpb.GetJobResponse:
        async with grpc.aio.insecure_channel(approving.address) as channel:
            device = StubDevice(channel)
            device.metadata = enrolled.metadata
            return await device.get_job()

    device, asked = approving.submit(enroll_and_ask()).result(timeout=30)
    assert asked.status == rpb.RUNNER_STATUS_RETRY and "awaits an operator's approval" in asked.message
    pending = json.loads(cli("device", "list", "--state", "pending", "--format", "json").stdout)
    assert [(d["device_id"], d["state"]) for d in pending] == [(device.device_id, "PENDING")]

    approved = cli("device", "approve", device.device_id)
    assert approved.exit_code == 0, approved.output
    assert approved.stdout.strip() == f"device {device.device_id} ONLINE"
    assert approving.submit(ask(device)).result(timeout=30).status == rpb.RUNNER_STATUS_NO_JOB
    assert json.loads(cli("device", "list", "--state", "pending", "--format", "json").stdout) == []

    unknown = cli("device", "approve", "no-such-device")
    assert unknown.exit_code == 1 and unknown.stderr.startswith("error: NOT_FOUND: ")
    assert "Traceback" not in unknown.output
