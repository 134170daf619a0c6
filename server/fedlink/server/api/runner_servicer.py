"""RunnerService: protobuf in, device protocol calls, protobuf out. Nothing else happens here."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from datetime import UTC

from google.protobuf.message import Message

from fedlink.common.errors import InvalidArgument
from fedlink.common.status import DeviceStatus
from fedlink.common.version import PROTOCOL_VERSION
from fedlink.server.api.durations import duration_field
from fedlink.server.api.report_view import REPORT_RESULT_VIEW, read_report
from fedlink.server.api.rpc import Call
from fedlink.server.api.uploads import split_upload
from fedlink.server.domain import Device, ResultStatus
from fedlink.server.protocol.device import DeviceProtocol, ResultInput, TaskReply
from fedlink.server.protocol.possession import receive_device_upload, upload_status
from fedlink.server.protocol.transfers import send_blob
from fedlink.server.store import StateStore, UploadQuota
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as pb

_STATUS = {
    DeviceStatus.OK: pb.RUNNER_STATUS_OK,
    DeviceStatus.RETRY: pb.RUNNER_STATUS_RETRY,
    DeviceStatus.NO_JOB: pb.RUNNER_STATUS_NO_JOB,
    DeviceStatus.NO_TASK: pb.RUNNER_STATUS_NO_TASK,
    DeviceStatus.DONE: pb.RUNNER_STATUS_DONE,
    DeviceStatus.STALE: pb.RUNNER_STATUS_STALE,
}
_RESULT_STATUS = {
    states_pb2.RESULT_STATUS_SUCCEEDED: ResultStatus.SUCCEEDED,
    states_pb2.RESULT_STATUS_FAILED: ResultStatus.FAILED,
}


class RunnerServicer:
    """Implements fedlink.v1.RunnerService over :class:`DeviceProtocol`."""

    #: ReportResult's inline DXO stays bytes until the device protocol checks it off the event loop.
    request_types: Mapping[str, type[Message]] = {"ReportResult": REPORT_RESULT_VIEW}

    def __init__(
        self,
        protocol: DeviceProtocol,
        store: StateStore,
        *,
        max_blob_bytes: int,
        upload_quota: UploadQuota | None = None,
    ) -> None:
        self._protocol = protocol
        self._store = store
        self._blobs = store.blobs
        self._max_blob_bytes = max_blob_bytes
        self._upload_quota = upload_quota
        self._payloads: dict[str, dxo_pb2.Dxo] = {}

    def _device(self, call: Call) -> Device:
        device = call.principal.device
        assert device is not None  # the authenticator of this service only lets devices in
        return device

    async def Enroll(self, request: pb.EnrollRequest, call: Call) -> pb.EnrollResponse:
        enrolment = await self._protocol.enroll(
            join_secret=request.join_secret,
            device_info=dict(request.device_info),
            user_info=dict(request.user_info),
            protocol_version=request.protocol_version,
            request_id=request.request_id,
        )
        return pb.EnrollResponse(
            device_id=enrolment.device_id,
            device_credential=enrolment.credential,
            protocol_version=PROTOCOL_VERSION,
            # The domain's state names are the wire's without the prefix (a test checks they agree).
            state=states_pb2.DeviceState.Value(f"DEVICE_STATE_{enrolment.state.value}"),
        )

    async def GetJob(self, request: pb.GetJobRequest, call: Call) -> pb.GetJobResponse:
        reply = await self._protocol.get_job(
            self._device(call),
            job_name=request.job_name,
            device_info=dict(request.device_info),
            protocol_version=request.protocol_version,
        )
        response = pb.GetJobResponse(status=_STATUS[reply.status], message=reply.message)
        if reply.job is not None:
            response.job_id = reply.job.job_id
            response.job_name = reply.job.name
            response.job_data = reply.job.job_data
        if reply.retry_after is not None:
            response.retry_after.FromTimedelta(reply.retry_after)
        return response

    async def GetTask(self, request: pb.GetTaskRequest, call: Call) -> pb.GetTaskResponse:
        if not request.job_id:
            raise InvalidArgument("job_id is required")
        wait = duration_field(request, "wait_timeout")
        reply = await self._protocol.get_task(
            self._device(call), job_id=request.job_id, cookie=request.cookie, wait=wait
        )
        return self._task_response(reply)

    def _task_response(self, reply: TaskReply) -> pb.GetTaskResponse:
        response = pb.GetTaskResponse(status=_STATUS[reply.status], cookie=reply.cookie)
        if reply.retry_after is not None:
            response.retry_after.FromTimedelta(reply.retry_after)
        if reply.task is None or reply.assignment is None:
            return response
        response.task_id = reply.task.task_id
        response.task_name = reply.task.name
        response.round = reply.task.round
        if reply.task.model_version is not None:
            response.model_version = reply.task.model_version
        response.assignment_id = reply.assignment.assignment_id
        response.deadline.FromDatetime(reply.task.deadline.astimezone(UTC))
        response.lease_expire_time.FromDatetime(reply.assignment.lease_expires_at.astimezone(UTC))
        payload = reply.payload
        if payload is not None:
            if payload.inline is not None:
                response.task_data.dxo.CopyFrom(self._parsed(payload.sha256, payload.inline))
            else:
                response.task_data.blob.sha256 = payload.sha256
                response.task_data.blob.size_bytes = payload.size_bytes
        return response

    def _parsed(self, sha256: str, data: bytes) -> dxo_pb2.Dxo:
        # Thousands of devices get the same global model each round: parse it once.
        message = self._payloads.get(sha256)
        if message is None:
            message = dxo_pb2.Dxo.FromString(data)
            if len(self._payloads) >= 4:
                self._payloads.pop(next(iter(self._payloads)))
            self._payloads[sha256] = message
        return message

    async def ReportResult(self, request: Message, call: Call) -> pb.ReportResultResponse:
        fields = read_report(request)  # parsed as REPORT_RESULT_VIEW: the inline DXO is its bytes
        del request
        status = _RESULT_STATUS.get(fields.status)  # type: ignore[call-overload]
        if status is None:
            raise InvalidArgument("status must be RESULT_STATUS_SUCCEEDED or RESULT_STATUS_FAILED")
        succeeded = status is ResultStatus.SUCCEEDED
        reply = await self._protocol.report_result(
            self._device(call),
            ResultInput(
                job_id=fields.job_id,
                task_id=fields.task_id,
                cookie=fields.cookie,
                status=status,
                inline=fields.inline if succeeded else None,
                blob_sha256=fields.blob_sha256 if succeeded else None,
                error_message=fields.error_message,
                request_id=fields.request_id,
            ),
        )
        return pb.ReportResultResponse(
            status=_STATUS[reply.status], cookie=reply.cookie, message=reply.message
        )

    async def RenewLease(self, request: pb.RenewLeaseRequest, call: Call) -> pb.RenewLeaseResponse:
        reply = await self._protocol.renew_lease(
            self._device(call), job_id=request.job_id, task_id=request.task_id, cookie=request.cookie
        )
        response = pb.RenewLeaseResponse(status=_STATUS[reply.status])
        if reply.lease_expires_at is not None:
            response.lease_expire_time.FromDatetime(reply.lease_expires_at.astimezone(UTC))
        return response

    async def ReleaseAssignment(
        self, request: pb.ReleaseAssignmentRequest, call: Call
    ) -> pb.ReleaseAssignmentResponse:
        reply = await self._protocol.release(
            self._device(call), job_id=request.job_id, task_id=request.task_id, cookie=request.cookie
        )
        return pb.ReleaseAssignmentResponse(status=_STATUS[reply.status])

    async def SignOff(self, request: pb.SignOffRequest, call: Call) -> pb.SignOffResponse:
        reply = await self._protocol.sign_off(self._device(call), reason=request.reason)
        return pb.SignOffResponse(status=_STATUS[reply.status], released_assignments=reply.released)

    async def UploadBlob(
        self, requests: AsyncIterator[pb.UploadBlobRequest], call: Call
    ) -> pb.UploadBlobResponse:
        # The device's own upload: it proves the device holds the bytes (stored once whoever uploads).
        header, chunks = await split_upload(requests)
        ref = await receive_device_upload(
            self._store,
            self._device(call).device_id,
            sha256=header.sha256,
            size_bytes=header.size_bytes,
            offset=header.offset,
            chunks=chunks,
            max_bytes=self._max_blob_bytes,
            quota=self._upload_quota,
        )
        response = pb.UploadBlobResponse()
        response.blob.sha256 = ref.sha256
        response.blob.size_bytes = ref.size_bytes
        return response

    async def GetBlobUploadStatus(
        self, request: pb.GetBlobUploadStatusRequest, call: Call
    ) -> pb.GetBlobUploadStatusResponse:
        # Only the device's own upload: a blob it does not hold reads as nothing received.
        received, complete = await upload_status(self._store, self._device(call).device_id, request.sha256)
        return pb.GetBlobUploadStatusResponse(received_bytes=received, complete=complete)

    async def DownloadBlob(self, request: pb.DownloadBlobRequest, call: Call) -> AsyncIterator[Serialized]:
        """Streams a blob the device may read: DownloadBlobResponse messages, already serialized."""
        await self._protocol.check_blob_access(self._device(call), request.sha256)
        async for offset, data, size in send_blob(
            self._blobs, request.sha256, offset=request.offset, max_chunk_bytes=request.max_chunk_bytes
        ):
            # Encoded by hand: building the message and serializing it would copy each chunk twice.
            yield Serialized(encode_download_chunk(offset, data, size))


class Serialized:
    """A response already in wire form; the service's serializer sends its bytes as they are."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def SerializeToString(self, **_options: object) -> bytes:
        """The wire bytes."""
        return self._data


def encode_download_chunk(offset: int, data: bytes, size_bytes: int) -> bytes:
    """The bytes ``DownloadBlobResponse(offset=, data=, size_bytes=).SerializeToString()`` gives, copying
    ``data`` once."""
    parts: list[bytes] = []
    if offset:
        parts += (b"\x08", _varint(offset))  # field 1 (offset), varint
    if data:
        parts += (b"\x12", _varint(len(data)), data)  # field 2 (data), length-delimited
    if size_bytes:
        parts += (b"\x18", _varint(size_bytes))  # field 3 (size_bytes), varint
    return b"".join(parts)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
