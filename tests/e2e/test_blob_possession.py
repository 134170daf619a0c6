"""Proof of possession over real gRPC and a real store: a device learns nothing of another device's blob
by its hash and cannot report it as its own, until it uploads the same bytes itself (kept once)."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator

import grpc
import pytest

from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import StubDevice
from .test_access_walk import RUNNER, Held, World, _update_dxo, walk
from .test_access_walk import world as world  # the fixture: a coordinator mid-round

UPDATE = _update_dxo().SerializeToString(deterministic=True)
SHA = hashlib.sha256(UPDATE).hexdigest()
NOWHERE = hashlib.sha256(b"no device ever uploaded this").hexdigest()
HALF = len(UPDATE) // 2


def _parts(data: bytes, *, offset: int = 0, end: int | None = None) -> Iterator[rpb.UploadBlobRequest]:
    sha = hashlib.sha256(data).hexdigest()
    yield rpb.UploadBlobRequest(
        header=dxo_pb2.BlobUploadHeader(sha256=sha, size_bytes=len(data), offset=offset)
    )
    yield rpb.UploadBlobRequest(chunk=data[offset:end])


async def _upload(device: StubDevice, data: bytes, *, offset: int = 0, end: int | None = None) -> None:
    reply = await device.stub.UploadBlob(_parts(data, offset=offset, end=end), metadata=device.metadata)
    assert reply.blob.sha256 == hashlib.sha256(data).hexdigest()


async def _status(device: StubDevice, sha: str) -> tuple[int, bool]:
    reply = await device.stub.GetBlobUploadStatus(
        rpb.GetBlobUploadStatusRequest(sha256=sha), metadata=device.metadata
    )
    return reply.received_bytes, reply.complete


def _report(w: World, held: Held, sha: str) -> rpb.ReportResultRequest:
    request = rpb.ReportResultRequest(
        job_id=w.job_id,
        task_id=held.task.task_id,
        cookie=held.task.cookie,
        status=states_pb2.RESULT_STATUS_SUCCEEDED,
        request_id=str(uuid.uuid4()),
    )
    request.result.blob.sha256 = sha
    request.result.blob.size_bytes = len(UPDATE)
    return request


async def _code(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def test_another_devices_blob_is_invisible_until_uploaded_again_and_then_stored_once(
    world: World,
) -> None:
    a, b, d = world.a.device, world.b.device, world.d
    await _upload(a, UPDATE)
    assert await _status(a, SHA) == (len(UPDATE), True)
    # B and D, who never uploaded it, see exactly what they see of a blob that does not exist.
    for device in (b, d):
        assert await _status(device, SHA) == (0, False) == await _status(device, NOWHERE)

    # B cannot report A's blob as its own, nor one that does not exist, and the refusal stores nothing.
    refused = {"ReportResult": grpc.StatusCode.PERMISSION_DENIED}
    for sha in (SHA, NOWHERE):
        await walk(world, RUNNER, {"ReportResult": _report(world, world.b, sha)}, b.metadata, refused)
    with pytest.raises(grpc.aio.AioRpcError) as refusal:
        await b.stub.ReportResult(_report(world, world.b, SHA), metadata=b.metadata)
    assert "not uploaded by this device" in (refusal.value.details() or "")

    # B uploads the same bytes: half, then it asks where to resume (its own upload, not A's blob).
    before = await world.snapshot()
    stream = b.stub.UploadBlob(_parts(UPDATE, end=HALF), metadata=b.metadata)
    assert await _code(stream) is grpc.StatusCode.INVALID_ARGUMENT  # the stream ended early
    assert await _status(b, SHA) == (HALF, False)
    assert await _status(d, SHA) == (0, False)  # B's progress is B's alone
    assert await _status(a, SHA) == (len(UPDATE), True)
    await _upload(b, UPDATE, offset=HALF)
    assert await _status(b, SHA) == (len(UPDATE), True)
    after = await world.snapshot()
    # Stored once: the blob row and the blob files are as before (the row counts as stored again now, so
    # that no collection takes it before B reports it); only B's grant was added.
    assert [row[:2] for row in after["blobs"]] == [row[:2] for row in before["blobs"]]
    assert after["blob files"] == before["blob files"]
    # No upload is in flight; B's complete upload is marked held (counted in its quota) until it reports it.
    assert [row[0][:3] for row in after["blob_uploads"]] == ["uh-", "uh-"]  # A's and B's
    assert set(after["blob_uploads"]) > set(before["blob_uploads"])
    new_grants = set(after["blob_grants"]) - set(before["blob_grants"])
    assert {(sha, device) for sha, device, _ in new_grants} == {(SHA, b.device_id)}

    # Now B holds it and may report it; so may A, who uploaded it first.
    for held in (world.b, world.a):
        reply = await held.device.stub.ReportResult(_report(world, held, SHA), metadata=held.device.metadata)
        assert reply.status == rpb.RUNNER_STATUS_OK
    for held in (world.a, world.b):
        (result,) = await world.store.list_results(task_id=held.task.task_id)
        assert (result.device_id, result.payload_sha256) == (held.device.device_id, SHA)


async def test_a_forged_upload_of_a_stored_hash_grants_nothing(world: World) -> None:
    a, b = world.a.device, world.b.device
    await _upload(a, UPDATE)
    forged = rpb.UploadBlobRequest(
        header=dxo_pb2.BlobUploadHeader(sha256=SHA, size_bytes=len(UPDATE), offset=0)
    )
    stream = b.stub.UploadBlob(
        iter([forged, rpb.UploadBlobRequest(chunk=bytes(len(UPDATE)))]), metadata=b.metadata
    )
    assert await _code(stream) is grpc.StatusCode.INVALID_ARGUMENT
    assert await _status(b, SHA) == (0, False)
    assert await _code(b.stub.ReportResult(_report(world, world.b, SHA), metadata=b.metadata)) is (
        grpc.StatusCode.PERMISSION_DENIED
    )
    # Nor does a header alone (which used to be answered OK for any stored hash).
    header_only = b.stub.UploadBlob(iter([forged]), metadata=b.metadata)
    assert await _code(header_only) is grpc.StatusCode.INVALID_ARGUMENT
    assert await world.store.blobs.read(SHA) == UPDATE


async def test_a_task_input_is_held_by_the_devices_handed_it_and_operators_see_every_blob(
    world: World,
) -> None:
    # The same rule as DownloadBlob: A holds a task whose input is the model, D holds none.
    assert await _status(world.a.device, world.model_sha) == (
        (await world.store.blobs.stat(world.model_sha)).size_bytes,
        True,
    )
    assert await _status(world.d, world.model_sha) == (0, False)
    await _upload(world.a.device, UPDATE)
    control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(world.channel)
    for sha in (SHA, world.model_sha):
        reply = await control.GetModelUploadStatus(
            cpb.GetModelUploadStatusRequest(sha256=sha), metadata=world.admin
        )
        assert reply.complete
