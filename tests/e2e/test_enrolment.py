"""Enrolment over real gRPC: caps and rate limits with a RetryInfo, approval, replays, info limits,
and selectors matched against what a device enrolled with, not what it later claims."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from fedlink.common.retry_info import retry_after_of
from fedlink.runner.transport.backoff import Backoff
from fedlink.runner.transport.grpc_transport import GrpcTransport, GrpcTransportConfig
from fedlink.runner.transport.state import Identity, StateDir
from fedlink.server.app import Coordinator
from fedlink.server.domain import DeviceState, ManualClock
from fedlink.server.protocol.enrolment import MAX_INFO_BYTES, MAX_INFO_ENTRIES
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb
from fedlink.v1 import runner_service_pb2_grpc as rgrpc

from .conftest import StubDevice, local_settings, upload_model, weights_dxo


class Served:
    """A coordinator on a ManualClock, with stubs for both services."""

    def __init__(self, coordinator: Coordinator, channel: grpc.aio.Channel, clock: ManualClock) -> None:
        self.coordinator = coordinator
        self.channel = channel
        self.clock = clock
        self.runner: rgrpc.RunnerServiceAsyncStub = rgrpc.RunnerServiceStub(channel)
        self.control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
        self.admin = (("authorization", f"Bearer {coordinator.admin_token}"),)

    async def enroll(self, request_id: str | None = None, /, **fields: Any) -> rpb.EnrollResponse:
        request = rpb.EnrollRequest(
            protocol_version="1.0", request_id=request_id or str(uuid.uuid4()), **fields
        )
        return await self.runner.Enroll(request)

    async def device_state(self, device_id: str) -> int:
        listed = await self.control.ListDevices(cpb.ListDevicesRequest(), metadata=self.admin)
        return {d.device_id: d.state for d in listed.devices}[device_id]


@contextlib.asynccontextmanager
async def serve(tmp_path: Path, **settings: Any) -> AsyncIterator[Served]:
    clock = ManualClock()
    async with Coordinator(local_settings(tmp_path, **settings), clock=clock) as coordinator:
        assert coordinator.endpoint is not None
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            yield Served(coordinator, channel, clock)


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[Served]:
    async with serve(tmp_path) as s:
        yield s


async def refused(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def test_the_device_cap_refuses_with_a_retry_info_until_a_device_is_revoked(tmp_path: Path) -> None:
    async with serve(tmp_path, max_devices=2) as s:
        first, _ = await s.enroll(), await s.enroll()
        error = await refused(s.enroll())
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "cap of 2" in (error.details() or "")
        assert retry_after_of(error.trailing_metadata()) == timedelta(minutes=5)
        await s.control.RevokeDevice(cpb.RevokeDeviceRequest(device_id=first.device_id), metadata=s.admin)
        assert (await s.enroll()).device_id


async def test_the_enrolment_rate_limit_says_when_to_retry_and_spares_replays(tmp_path: Path) -> None:
    async with serve(tmp_path, enrolments_per_minute=60, enrolment_burst=2) as s:
        replayed = str(uuid.uuid4())
        first = await s.enroll(replayed)
        await s.enroll()
        error = await refused(s.enroll())
        assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert retry_after_of(error.trailing_metadata()) == timedelta(seconds=1)  # one a second
        again = await s.enroll(replayed)  # a retry of an enrolment is no new device: never limited
        assert again.device_credential == first.device_credential
        s.clock.advance(timedelta(seconds=1))
        assert (await s.enroll()).device_id
        assert (await refused(s.enroll())).code() is grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_an_enroll_replay_gets_the_credential_only_soon_and_only_for_the_same_request(
    served: Served,
) -> None:
    request_id = str(uuid.uuid4())
    info: dict[str, Any] = {"device_info": {"platform": "android"}, "user_info": {"user": "u1"}}
    first = await served.enroll(request_id, **info)
    served.clock.advance(timedelta(minutes=4))
    again = await served.enroll(request_id, **info)
    assert (again.device_id, again.device_credential) == (first.device_id, first.device_credential)
    # Someone who learnt the request id but not the request: no credential.
    other = await refused(served.enroll(request_id, device_info={"platform": "android"}))
    assert other.code() is grpc.StatusCode.ALREADY_EXISTS
    assert "another enrolment request" in (other.details() or "")
    secret = await refused(served.enroll(request_id, join_secret="guess", **info))
    assert secret.code() is grpc.StatusCode.ALREADY_EXISTS
    # The same request once the replay window (5 minutes) is over: no credential either.
    served.clock.advance(timedelta(minutes=2))
    late = await refused(served.enroll(request_id, **info))
    assert late.code() is grpc.StatusCode.ALREADY_EXISTS
    assert "not shown again" in (late.details() or "")
    # The device itself is untouched.
    assert await served.device_state(first.device_id) == states_pb2.DEVICE_STATE_ONLINE
    # A revoked device's enrolment, replayed in time, does not bring it back.
    replayed = str(uuid.uuid4())
    revoked = await served.enroll(replayed)
    await served.control.RevokeDevice(
        cpb.RevokeDeviceRequest(device_id=revoked.device_id), metadata=served.admin
    )
    assert (await refused(served.enroll(replayed))).code() is grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("field", ["device_info", "user_info"])
async def test_device_and_user_info_are_capped_in_entries_and_bytes(served: Served, field: str) -> None:
    many = {f"k{i}": "v" for i in range(MAX_INFO_ENTRIES + 1)}
    error = await refused(served.enroll(**{field: many}))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field} has {MAX_INFO_ENTRIES + 1} entries" in (error.details() or "")
    big = {"blob": "x" * MAX_INFO_BYTES}
    error = await refused(served.enroll(**{field: big}))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "bytes of keys and values" in (error.details() or "")
    at_the_cap = {f"k{i:02d}": "v" * 200 for i in range(MAX_INFO_ENTRIES)}  # 64 × 203 bytes ≤ 16 KiB
    assert (await served.enroll(**{field: at_the_cap})).device_id


async def test_a_device_awaiting_approval_is_told_so_and_can_do_nothing_else(tmp_path: Path) -> None:
    async with serve(tmp_path, require_approval=True) as s:
        enrolled = await s.enroll(device_info={"platform": "linux"})
        assert enrolled.state == states_pb2.DEVICE_STATE_PENDING
        device = StubDevice(s.channel)
        device.device_id = enrolled.device_id
        device.metadata = (("authorization", f"Bearer {enrolled.device_credential}"),)
        asked = await device.get_job()
        assert asked.status == rpb.RUNNER_STATUS_RETRY and asked.retry_after.ToTimedelta() > timedelta(0)
        assert f"fedlink device approve {enrolled.device_id}" in asked.message
        for call in (
            device.get_task("job-1", wait_s=0.1),
            device.stub.GetBlobUploadStatus(
                rpb.GetBlobUploadStatusRequest(sha256="0" * 64), metadata=device.metadata
            ),
        ):
            error = await refused(call)
            assert error.code() is grpc.StatusCode.PERMISSION_DENIED
            assert "awaits an operator's approval" in (error.details() or "")
        pending = await s.control.ListDevices(
            cpb.ListDevicesRequest(state=states_pb2.DEVICE_STATE_PENDING), metadata=s.admin
        )
        assert [d.device_id for d in pending.devices] == [enrolled.device_id]
        approved = await s.control.ApproveDevice(
            cpb.ApproveDeviceRequest(device_id=enrolled.device_id), metadata=s.admin
        )
        assert approved.device.state == states_pb2.DEVICE_STATE_ONLINE
        assert (await device.get_job()).status == rpb.RUNNER_STATUS_NO_JOB
        again = await s.control.ApproveDevice(
            cpb.ApproveDeviceRequest(device_id=enrolled.device_id), metadata=s.admin
        )
        assert again.device.state == states_pb2.DEVICE_STATE_ONLINE
        unknown = await refused(
            s.control.ApproveDevice(cpb.ApproveDeviceRequest(device_id="dev-unknown"), metadata=s.admin)
        )
        assert unknown.code() is grpc.StatusCode.NOT_FOUND
        await s.control.RevokeDevice(cpb.RevokeDeviceRequest(device_id=enrolled.device_id), metadata=s.admin)
        revoked = await refused(
            s.control.ApproveDevice(cpb.ApproveDeviceRequest(device_id=enrolled.device_id), metadata=s.admin)
        )
        assert revoked.code() is grpc.StatusCode.FAILED_PRECONDITION


async def test_a_job_selector_matches_the_device_info_recorded_at_enrolment(served: Served) -> None:
    linux = await StubDevice(served.channel).enroll(info={"platform": "linux"})
    android = await StubDevice(served.channel).enroll(info={"platform": "android"})
    spec = cpb.JobSpec(name="phones", initial_model=dxo_pb2.BlobRef(sha256=""))
    spec.initial_model.sha256 = await upload_model(
        served.control, weights_dxo({"w": np.zeros(2, np.float32)}), served.admin
    )
    spec.fedavg.num_rounds = 1
    spec.device_selector["platform"] = "android"
    job = (await served.control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=served.admin)).job
    # The linux device claims to be an android one: the claim is not what selectors match.
    claimed = await linux.stub.GetJob(
        rpb.GetJobRequest(device_info={"platform": "android"}, protocol_version="1.0"),
        metadata=linux.metadata,
    )
    assert claimed.status == rpb.RUNNER_STATUS_NO_JOB
    assert (await android.get_job()).job_id == job.job_id


async def test_the_runner_waits_out_a_rate_limit_and_enrols_anew_when_its_replay_is_refused(
    tmp_path: Path,
) -> None:
    async with serve(tmp_path, enrolments_per_minute=60, enrolment_burst=1) as s:
        assert s.coordinator.endpoint is not None
        address = s.coordinator.endpoint.address

        def transport(name: str) -> GrpcTransport:
            return GrpcTransport(
                GrpcTransportConfig(
                    server=address,
                    state_dir=tmp_path / name,
                    insecure=True,
                    # No retries of faults that do not say when: only the RetryInfo makes it wait.
                    limited_retries=0,
                    backoff=Backoff(base=timedelta(milliseconds=10), cap=timedelta(milliseconds=20)),
                )
            )

        await s.enroll()  # the burst is spent
        limited = transport("limited")
        opening = asyncio.create_task(limited.open())
        for _ in range(500):  # bounded: a transport that never asks fails the assertion below
            if ("Enroll", "RESOURCE_EXHAUSTED") in limited.failed_attempts:
                break
            await asyncio.sleep(0.01)
        # The transport waits the second the RetryInfo asked for; by the coordinator's clock a token is
        # back then.
        s.clock.advance(timedelta(seconds=1))
        await asyncio.wait_for(opening, 10)
        await limited.close()
        assert ("Enroll", "RESOURCE_EXHAUSTED") in limited.failed_attempts
        assert limited.device_id.startswith("dev-")

        # A runner that crashed after saving its request id, back after the replay window: its first
        # enrolment is not answered again, so it enrols anew under a fresh request id.
        crashed = StateDir(tmp_path / "crashed")
        request_id = str(uuid.uuid4())
        s.clock.advance(timedelta(seconds=1))
        lost = await s.enroll(request_id)  # the reply that never arrived
        crashed.save_identity(Identity(enroll_request_id=request_id, server=address))
        s.clock.advance(timedelta(minutes=6))
        back = transport("crashed")
        await back.open()
        await back.close()
        assert back.device_id != lost.device_id
        saved = crashed.load_identity()
        assert saved is not None and saved.enroll_request_id != request_id


async def test_a_pending_device_is_never_sampled(tmp_path: Path) -> None:
    async with serve(tmp_path, require_approval=True) as s:
        enrolled = await s.enroll()
        device = StubDevice(s.channel)
        device.metadata = (("authorization", f"Bearer {enrolled.device_credential}"),)
        await device.get_job()  # asked for work: still not eligible until approved
        store = s.coordinator.store
        assert store is not None
        assert (await store.get_device(enrolled.device_id)).state is DeviceState.PENDING
        assert await store.online_devices(with_info=False, job_name="any") == []
