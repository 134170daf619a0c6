"""The access walk: every RPC of both services, generated from their descriptors, refuses the callers it
must (no credential, a device on the control API, another device's task or blob, a revoked device, the
admin token on the device API), and no refusal changes the store."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import sqlalchemy as sa
from google.protobuf import message as pb_message
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor

from fedlink.server.app import Coordinator
from fedlink.server.store import SqlStateStore
from fedlink.server.store.schema import metadata as schema_metadata
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, runner_service_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import Metadata, StubDevice, dense, local_settings, upload_model, weights_dxo

RUNNER = runner_service_pb2.DESCRIPTOR.services_by_name["RunnerService"]
CONTROL = cpb.DESCRIPTOR.services_by_name["ControlService"]
JOIN_SECRET = "join-secret-for-the-access-walk"
# Columns that change with time alone (presence, the run's driver lease), not with what a caller did.
_VOLATILE = {"devices": {"last_seen"}, "runs": {"owner_lease_expires_at", "updated_at"}}

Request = pb_message.Message | Sequence[pb_message.Message]
Snapshot = dict[str, list[tuple[Any, ...]]]


def _bearer(token: str) -> Metadata:
    return (("authorization", f"Bearer {token}"),)


async def call_rpc(
    channel: grpc.aio.Channel,
    service: ServiceDescriptor,
    method: MethodDescriptor,
    request: Request,
    metadata: Metadata,
) -> tuple[grpc.StatusCode, str]:
    """Calls any RPC by its descriptor (unary, client or server stream); returns its status and details."""
    path = f"/{service.full_name}/{method.name}"
    reply_cls = message_factory.GetMessageClass(method.output_type)
    codec: dict[str, Callable[..., Any]] = {
        "request_serializer": lambda m: m.SerializeToString(),
        "response_deserializer": reply_cls.FromString,
    }
    # A bounded deadline: a rule that broke must fail the test, not leave a long poll or watch hanging.
    options: dict[str, Any] = {"metadata": metadata, "timeout": 5.0}
    try:
        if method.client_streaming:
            assert isinstance(request, Sequence)
            await channel.stream_unary(path, **codec)(iter(request), **options)
        elif method.server_streaming:
            assert isinstance(request, pb_message.Message)
            async for _ in channel.unary_stream(path, **codec)(request, **options):
                pass
        else:
            assert isinstance(request, pb_message.Message)
            await channel.unary_unary(path, **codec)(request, **options)
    except grpc.aio.AioRpcError as error:
        return error.code(), error.details() or ""
    return grpc.StatusCode.OK, ""


async def snapshot(store: SqlStateStore, blob_dir: Path) -> Snapshot:
    """Every row of every table (minus time-driven columns), and the blob files on disk."""
    out: Snapshot = {}
    async with store.database.read() as conn:
        for table in schema_metadata.sorted_tables:
            skip = _VOLATILE.get(table.name, set())
            columns = [c for c in table.columns if c.name not in skip]
            rows = (await conn.execute(sa.select(*columns))).all()
            out[table.name] = sorted((tuple(r) for r in rows), key=repr)
    out["blob files"] = await asyncio.to_thread(_blob_files, blob_dir)
    return out


def _blob_files(blob_dir: Path) -> list[tuple[Any, ...]]:
    return sorted((str(p.relative_to(blob_dir)),) for p in blob_dir.rglob("*") if p.is_file())


@dataclass(slots=True, kw_only=True)
class Held:
    """A device with the task it holds in the open round."""

    device: StubDevice
    task: rpb.GetTaskResponse


@dataclass(slots=True, kw_only=True)
class World:
    """A coordinator mid-round: A and B hold tasks, C held one and was revoked, D joined late."""

    coordinator: Coordinator
    channel: grpc.aio.Channel
    admin: Metadata
    job_id: str
    model_sha: str
    a: Held
    b: Held
    c: Held
    c_enrolment: rpb.EnrollRequest
    d: StubDevice

    @property
    def store(self) -> SqlStateStore:
        assert self.coordinator.store is not None
        return self.coordinator.store

    async def snapshot(self) -> Snapshot:
        return await snapshot(self.store, self.coordinator.settings.blob_dir)


def _enrolment() -> rpb.EnrollRequest:
    return rpb.EnrollRequest(
        join_secret=JOIN_SECRET,
        device_info={"platform": "test"},
        protocol_version="1.0",
        request_id=str(uuid.uuid4()),
    )


async def _enrol(channel: grpc.aio.Channel, request: rpb.EnrollRequest) -> StubDevice:
    device = StubDevice(channel)
    reply = await device.stub.Enroll(request)
    device.device_id = reply.device_id
    device.metadata = _bearer(reply.device_credential)
    return device


async def _take_task(device: StubDevice, job_id: str) -> Held:
    for _ in range(100):
        task = await device.get_task(job_id, wait_s=0.5)
        if task.status == rpb.RUNNER_STATUS_OK:
            return Held(device=device, task=task)
    raise AssertionError(f"device {device.device_id} got no task")


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    settings = local_settings(tmp_path, open_enrolment=False, join_secret=JOIN_SECRET)
    async with Coordinator(settings) as coordinator:
        assert coordinator.endpoint is not None
        admin = _bearer(coordinator.admin_token)
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
            c_enrolment = _enrolment()
            a, b, c = [await _enrol(channel, r) for r in (_enrolment(), _enrolment(), c_enrolment)]
            for device in (a, b, c):  # runners ask for work first: only devices that asked are sampled
                await device.get_job()
            model = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
            sha = await upload_model(control, weights_dxo(model), admin)
            spec = cpb.JobSpec(name="walk", initial_model=dxo_pb2.BlobRef(sha256=sha))
            spec.fedavg.num_rounds = 1
            spec.fedavg.min_devices = 3
            spec.fedavg.round_timeout.FromSeconds(120)
            job = (await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)).job
            held = [await _take_task(d, job.job_id) for d in (a, b, c)]
            await control.RevokeDevice(cpb.RevokeDeviceRequest(device_id=c.device_id), metadata=admin)
            d = await _enrol(channel, _enrolment())  # after the round started: holds no task
            yield World(
                coordinator=coordinator,
                channel=channel,
                admin=admin,
                job_id=job.job_id,
                model_sha=sha,
                a=held[0],
                b=held[1],
                c=held[2],
                c_enrolment=c_enrolment,
                d=d,
            )


def _update_dxo() -> dxo_pb2.Dxo:
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    dxo.data["w"].CopyFrom(dense(np.ones((2, 3), np.float32)))
    dxo.meta["num_examples"].int_value = 5
    return dxo


def _upload(sha_seed: bytes, cls: type[rpb.UploadBlobRequest] | type[cpb.UploadModelRequest]) -> Request:
    data = weights_dxo({"x": np.full(4, float(len(sha_seed)), np.float32)}).SerializeToString() + sha_seed
    header = dxo_pb2.BlobUploadHeader(sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
    return [cls(header=header), cls(chunk=data)]


def runner_requests(w: World, held: Held) -> dict[str, Request]:
    """A request per RunnerService RPC that would succeed for the holder of ``held``'s task."""
    task = held.task
    report = rpb.ReportResultRequest(
        job_id=w.job_id,
        task_id=task.task_id,
        cookie=task.cookie,
        status=states_pb2.RESULT_STATUS_SUCCEEDED,
        request_id=str(uuid.uuid4()),
    )
    report.result.dxo.CopyFrom(_update_dxo())
    get_task = rpb.GetTaskRequest(job_id=w.job_id, cookie=task.cookie)
    get_task.wait_timeout.FromMilliseconds(200)
    return {
        "Enroll": rpb.EnrollRequest(protocol_version="1.0", request_id=str(uuid.uuid4())),
        "GetJob": rpb.GetJobRequest(protocol_version="1.0"),
        "GetTask": get_task,
        "ReportResult": report,
        "RenewLease": rpb.RenewLeaseRequest(
            job_id=w.job_id, task_id=task.task_id, cookie=task.cookie, request_id=str(uuid.uuid4())
        ),
        "ReleaseAssignment": rpb.ReleaseAssignmentRequest(
            job_id=w.job_id, task_id=task.task_id, cookie=task.cookie, request_id=str(uuid.uuid4())
        ),
        "UploadBlob": _upload(b"runner", rpb.UploadBlobRequest),
        "GetBlobUploadStatus": rpb.GetBlobUploadStatusRequest(sha256=w.model_sha),
        "DownloadBlob": rpb.DownloadBlobRequest(sha256=w.model_sha),
        "SignOff": rpb.SignOffRequest(reason="walk", request_id=str(uuid.uuid4())),
    }


def control_requests(w: World) -> dict[str, Request]:
    """A request per ControlService RPC that would succeed (or change something) for the admin."""
    spec = cpb.JobSpec(name="intruder", initial_model=dxo_pb2.BlobRef(sha256=w.model_sha))
    spec.fedavg.num_rounds = 1
    return {
        "SubmitJob": cpb.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4())),
        "DescribeJob": cpb.DescribeJobRequest(job_id=w.job_id),
        "ListJobs": cpb.ListJobsRequest(),
        "AbortJob": cpb.AbortJobRequest(job_id=w.job_id, reason="intruder"),
        "DeleteJob": cpb.DeleteJobRequest(job_id=w.job_id),
        "WatchJob": cpb.WatchJobRequest(job_id=w.job_id),
        "ListDevices": cpb.ListDevicesRequest(),
        "RevokeDevice": cpb.RevokeDeviceRequest(device_id=w.a.device.device_id),
        "ApproveDevice": cpb.ApproveDeviceRequest(device_id=w.d.device_id),
        "UploadModel": _upload(b"control", cpb.UploadModelRequest),
        "GetModelUploadStatus": cpb.GetModelUploadStatusRequest(sha256=w.model_sha),
        "DownloadModel": cpb.DownloadModelRequest(job_id=w.job_id),
    }


def _covers(service: ServiceDescriptor, requests: Mapping[str, Request]) -> None:
    rpcs = {m.name for m in service.methods}
    assert set(requests) == rpcs, f"{service.name}: no case for {sorted(rpcs - set(requests))}"


async def walk(
    w: World,
    service: ServiceDescriptor,
    requests: Mapping[str, Request],
    metadata: Metadata,
    expected: Mapping[str, grpc.StatusCode],
) -> None:
    """Calls each RPC in ``expected``; each must get its code, and the store must not change."""
    before = await w.snapshot()
    failures: list[str] = []
    for name, code in expected.items():
        got, details = await call_rpc(
            w.channel, service, service.methods_by_name[name], requests[name], metadata
        )
        if got is not code:
            failures.append(f"{service.name}.{name}: {got.name} ({details!r}), expected {code.name}")
        elif not details:
            failures.append(f"{service.name}.{name}: {code.name} without a message")
        after = await w.snapshot()
        changed = [table for table in before if before[table] != after[table]]
        if changed:
            failures.append(f"{service.name}.{name}: the refused call changed {changed}")
            before = after
    assert not failures, "\n".join(failures)


def _every(service: ServiceDescriptor, code: grpc.StatusCode) -> dict[str, grpc.StatusCode]:
    return {m.name: code for m in service.methods}


UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED


async def test_every_rpc_has_a_case(world: World) -> None:
    _covers(RUNNER, runner_requests(world, world.a))
    _covers(CONTROL, control_requests(world))


async def test_without_a_credential_every_rpc_is_unauthenticated(world: World) -> None:
    runner = runner_requests(world, world.a)  # Enroll's case carries no join secret
    await walk(world, RUNNER, runner, (), _every(RUNNER, UNAUTHENTICATED))
    await walk(world, CONTROL, control_requests(world), (), _every(CONTROL, UNAUTHENTICATED))


async def test_a_credential_nobody_issued_is_unauthenticated(world: World) -> None:
    forged = _bearer("f" * 64)
    await walk(world, RUNNER, runner_requests(world, world.a), forged, _every(RUNNER, UNAUTHENTICATED))
    await walk(world, CONTROL, control_requests(world), forged, _every(CONTROL, UNAUTHENTICATED))


async def test_enrolment_needs_the_join_secret(world: World) -> None:
    wrong = rpb.EnrollRequest(join_secret="guess", protocol_version="1.0", request_id=str(uuid.uuid4()))
    await walk(world, RUNNER, {"Enroll": wrong}, (), {"Enroll": UNAUTHENTICATED})
    joined = await _enrol(world.channel, _enrolment())  # the secret itself works
    assert (await joined.get_job()).status == rpb.RUNNER_STATUS_OK


async def test_a_device_credential_on_the_control_api_is_permission_denied(world: World) -> None:
    await walk(
        world, CONTROL, control_requests(world), world.a.device.metadata, _every(CONTROL, PERMISSION_DENIED)
    )


async def test_a_device_cannot_act_on_another_devices_task(world: World) -> None:
    # A's credential with B's task and cookie.
    others = runner_requests(world, world.b)
    cases = ("GetTask", "ReportResult", "RenewLease", "ReleaseAssignment")
    await walk(world, RUNNER, others, world.a.device.metadata, {name: PERMISSION_DENIED for name in cases})
    # D holds no task: the model is the input of other devices' tasks only.
    await walk(world, RUNNER, others, world.d.metadata, {"DownloadBlob": PERMISSION_DENIED})
    # The same requests work for their owner: the refusals above were about who asked.
    for name, device in (
        ("RenewLease", world.b.device),
        ("ReportResult", world.b.device),
        ("DownloadBlob", world.a.device),
    ):
        code, details = await call_rpc(
            world.channel, RUNNER, RUNNER.methods_by_name[name], others[name], device.metadata
        )
        assert code is grpc.StatusCode.OK, f"{name} by its owner: {code.name} {details}"


async def test_a_revoked_device_is_unauthenticated_everywhere(world: World) -> None:
    requests = runner_requests(world, world.c)
    requests["Enroll"] = world.c_enrolment  # replaying its own enrolment must not bring it back
    await walk(world, RUNNER, requests, world.c.device.metadata, _every(RUNNER, UNAUTHENTICATED))


async def test_the_admin_token_is_not_a_device_credential(world: World) -> None:
    await walk(world, RUNNER, runner_requests(world, world.a), world.admin, _every(RUNNER, UNAUTHENTICATED))


async def test_the_walked_requests_succeed_for_their_rightful_callers(world: World) -> None:
    """The positive control: the refusals in this file are about the caller, not a broken request."""
    mine = runner_requests(world, world.a)
    del mine["Enroll"], mine["ReleaseAssignment"]  # Enroll needs the secret; release would end A's task
    for name, request in mine.items():
        code, details = await call_rpc(
            world.channel, RUNNER, RUNNER.methods_by_name[name], request, world.a.device.metadata
        )
        assert code is grpc.StatusCode.OK, f"RunnerService.{name}: {code.name} {details}"
    control = control_requests(world)
    for name in (
        "DescribeJob",
        "ListJobs",
        "ListDevices",
        "UploadModel",
        "GetModelUploadStatus",
        "DownloadModel",
    ):
        code, details = await call_rpc(
            world.channel, CONTROL, CONTROL.methods_by_name[name], control[name], world.admin
        )
        assert code is grpc.StatusCode.OK, f"ControlService.{name}: {code.name} {details}"
