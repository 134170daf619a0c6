"""``fedlink device``: list the enrolled devices, approve one that awaits approval, revoke one."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC
from typing import Final

import click

from fedlink.server.cli.client import (
    CALL_TIMEOUT_S,
    ConnectionOptions,
    collect_pages,
    connection_options,
    control_client,
    echo_json,
    echo_table,
    format_option,
)
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import states_pb2

_STATE_NAMES: Final = ("online", "offline", "revoked", "pending")


def _state(state: int) -> str:
    return states_pb2.DeviceState.Name(state).removeprefix("DEVICE_STATE_")  # type: ignore[arg-type]


def _time(device: cpb.Device, which: str) -> str:
    stamp = getattr(device, which)
    if not stamp.seconds and not stamp.nanos:
        return ""
    return str(stamp.ToDatetime(tzinfo=UTC).isoformat(timespec="seconds").replace("+00:00", "Z"))


def device_dict(device: cpb.Device) -> dict[str, object]:
    """A device as the JSON that ``--format json`` prints."""
    return {
        "device_id": device.device_id,
        "state": _state(device.state),
        "device_info": dict(sorted(device.device_info.items())),
        "user_info": dict(sorted(device.user_info.items())),
        "enroll_time": _time(device, "enroll_time"),
        "last_seen_time": _time(device, "last_seen_time"),
    }


@click.group(name="device")
def device_group() -> None:
    """List, approve and revoke the devices enrolled with a running coordinator."""


@device_group.command("list")
@click.option(
    "--state", type=click.Choice(_STATE_NAMES, case_sensitive=False), help="Only devices in this state."
)
@click.option(
    "--limit", type=click.IntRange(min=1), default=1000, show_default=True, help="At most this many."
)
@format_option()
@connection_options
def list_command(state: str | None, limit: int, output_format: str, connection: ConnectionOptions) -> None:
    """List the enrolled devices."""
    wanted = (
        states_pb2.DeviceState.Value(f"DEVICE_STATE_{state.upper()}")
        if state
        else states_pb2.DEVICE_STATE_UNSPECIFIED
    )
    with control_client(connection) as client:

        def page(size: int, token: str) -> tuple[Sequence[cpb.Device], str]:
            request = cpb.ListDevicesRequest(page_size=size, page_token=token, state=wanted)
            reply = client.stub.ListDevices(request, metadata=client.metadata, timeout=CALL_TIMEOUT_S)
            return reply.devices, reply.next_page_token

        devices = collect_pages(page, limit)
    if output_format == "json":
        echo_json([device_dict(d) for d in devices])
        return
    rows = [
        [
            d.device_id,
            _state(d.state),
            d.device_info.get("platform", ""),
            _time(d, "last_seen_time"),
        ]
        for d in devices
    ]
    echo_table(["DEVICE ID", "STATE", "PLATFORM", "LAST SEEN"], rows)


@device_group.command("approve")
@click.argument("device_id")
@connection_options
def approve_command(device_id: str, connection: ConnectionOptions) -> None:
    """Approve a device that awaits approval (serve --require-approval): it may take part in jobs."""
    with control_client(connection) as client:
        device = client.stub.ApproveDevice(
            cpb.ApproveDeviceRequest(device_id=device_id, request_id=str(uuid.uuid4())),
            metadata=client.metadata,
            timeout=CALL_TIMEOUT_S,
        ).device
    click.echo(f"device {device.device_id} {_state(device.state)}")


@device_group.command("revoke")
@click.argument("device_id")
@connection_options
def revoke_command(device_id: str, connection: ConnectionOptions) -> None:
    """Revoke a device's credential: its calls are refused and it is no longer sampled."""
    with control_client(connection) as client:
        device = client.stub.RevokeDevice(
            cpb.RevokeDeviceRequest(device_id=device_id, request_id=str(uuid.uuid4())),
            metadata=client.metadata,
            timeout=CALL_TIMEOUT_S,
        ).device
    click.echo(f"device {device.device_id} {_state(device.state)}")


__all__ = ["device_dict", "device_group"]
