"""ControlService: protobuf in, control protocol calls, protobuf out."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC
from typing import Any

from fedlink.common.errors import InvalidArgument
from fedlink.server.api.rpc import Call
from fedlink.server.api.uploads import receive_stream, upload_status
from fedlink.server.domain import Device, DeviceState, JobEvent, JobState, ResultStatus
from fedlink.server.protocol.control import ControlProtocol, JobSubmission, JobView
from fedlink.server.protocol.transfers import send_blob
from fedlink.server.store import BlobStore
from fedlink.server.workflows.wire import spec_from_wire, spec_to_wire
from fedlink.v1 import control_service_pb2 as pb
from fedlink.v1 import states_pb2

JOB_STATES = {
    JobState.PENDING: states_pb2.JOB_STATE_PENDING,
    JobState.RUNNING: states_pb2.JOB_STATE_RUNNING,
    JobState.FINISHED: states_pb2.JOB_STATE_FINISHED,
    JobState.FAILED: states_pb2.JOB_STATE_FAILED,
    JobState.ABORTED: states_pb2.JOB_STATE_ABORTED,
}
_JOB_STATES_BACK = {v: k for k, v in JOB_STATES.items()}
DEVICE_STATES = {
    DeviceState.ONLINE: states_pb2.DEVICE_STATE_ONLINE,
    DeviceState.OFFLINE: states_pb2.DEVICE_STATE_OFFLINE,
    DeviceState.REVOKED: states_pb2.DEVICE_STATE_REVOKED,
    DeviceState.PENDING: states_pb2.DEVICE_STATE_PENDING,
}
_DEVICE_STATES_BACK = {v: k for k, v in DEVICE_STATES.items()}


def job_message(view: JobView) -> pb.Job:
    """The wire form of a job."""
    job = view.job
    message = pb.Job(
        job_id=job.job_id,
        state=JOB_STATES[job.state],
        current_round=view.current_round,
        completed_rounds=view.completed_rounds,
        message=job.message,
        metrics=dict(view.metrics),
    )
    message.spec.name = job.name
    message.spec.job_data = job.job_data
    message.spec.device_selector.update(job.device_selector)
    if job.initial_model_sha256:
        message.spec.initial_model.sha256 = job.initial_model_sha256
        message.spec.initial_model.size_bytes = job.initial_model_size_bytes or 0
    spec_to_wire(job.workflow, message.spec)
    message.create_time.FromDatetime(job.created_at.astimezone(UTC))
    message.update_time.FromDatetime(job.updated_at.astimezone(UTC))
    return message


def device_message(device: Device) -> pb.Device:
    """The wire form of a device."""
    message = pb.Device(
        device_id=device.device_id,
        state=DEVICE_STATES[device.state],
        device_info=dict(device.device_info),
        user_info=dict(device.user_info),
    )
    message.enroll_time.FromDatetime(device.enrolled_at.astimezone(UTC))
    message.last_seen_time.FromDatetime(device.last_seen.astimezone(UTC))
    return message


def event_message(event: JobEvent) -> pb.WatchJobResponse:
    """The wire form of a job event."""
    body: dict[str, Any] = json.loads(event.payload_json)
    message = pb.WatchJobResponse(sequence=event.sequence, round=int(body.get("round", 0)))
    message.event_time.FromDatetime(event.time.astimezone(UTC))
    if event.kind == "round_started":
        message.round_started.num_devices = int(body.get("num_devices", 0))
    elif event.kind == "round_closed":
        message.round_closed.num_results = int(body.get("num_results", 0))
        metrics = body.get("metrics", {})
        message.round_closed.metrics.update({k: float(v) for k, v in metrics.items()})
    elif event.kind == "result_received":
        message.result_received.device_id = str(body.get("device_id", ""))
        succeeded = body.get("status") == ResultStatus.SUCCEEDED.value
        message.result_received.status = (
            states_pb2.RESULT_STATUS_SUCCEEDED if succeeded else states_pb2.RESULT_STATUS_FAILED
        )
        message.result_received.num_results = int(body.get("num_results", 0))
        message.result_received.error_message = str(body.get("error", ""))
    elif event.kind == "model_version":
        version = message.model_version
        version.num_updates = int(body.get("num_updates", 0))
        staleness = {int(k): int(v) for k, v in dict(body.get("staleness", {})).items()}
        version.staleness_counts.extend(staleness.get(k, 0) for k in range(max(staleness, default=-1) + 1))
        version.metrics.update({k: float(v) for k, v in dict(body.get("metrics", {})).items()})
        version.selection = int(body.get("selection", 0))
        counters = dict(body.get("counters", {}))
        version.num_failed = int(counters.get("failed", 0))
        version.num_lost = int(counters.get("lost", 0))
        version.num_stale = int(counters.get("stale", 0))
    elif event.kind == "job_state_changed":
        state = JOB_STATES[JobState(body["state"])]
        message.job_state_changed.state = state
        message.job_state_changed.message = str(body.get("message", ""))
        message.state = state
    return message


class ControlServicer:
    """Implements fedlink.v1.ControlService over :class:`ControlProtocol`."""

    def __init__(self, protocol: ControlProtocol, blobs: BlobStore, *, max_model_bytes: int) -> None:
        self._protocol = protocol
        self._blobs = blobs
        self._max_model_bytes = max_model_bytes

    async def SubmitJob(self, request: pb.SubmitJobRequest, call: Call) -> pb.SubmitJobResponse:
        spec = request.spec
        view = await self._protocol.submit_job(
            JobSubmission(
                name=spec.name,
                workflow=spec_from_wire(spec),
                job_data=spec.job_data,
                initial_model_sha256=spec.initial_model.sha256,
                initial_model_size_bytes=spec.initial_model.size_bytes,
                device_selector=dict(spec.device_selector),
            ),
            request_id=request.request_id,
        )
        return pb.SubmitJobResponse(job=job_message(view))

    async def DescribeJob(self, request: pb.DescribeJobRequest, call: Call) -> pb.DescribeJobResponse:
        return pb.DescribeJobResponse(job=job_message(await self._protocol.describe_job(request.job_id)))

    async def ListJobs(self, request: pb.ListJobsRequest, call: Call) -> pb.ListJobsResponse:
        state = _JOB_STATES_BACK.get(request.state) if request.state else None
        if request.state and state is None:
            raise InvalidArgument(f"unknown job state {request.state}")
        page = await self._protocol.list_jobs(
            page_size=min(max(request.page_size, 0), 1000), page_token=request.page_token, state=state
        )
        views = [await self._protocol.describe_job(job.job_id) for job in page.items]
        return pb.ListJobsResponse(jobs=[job_message(v) for v in views], next_page_token=page.next_page_token)

    async def AbortJob(self, request: pb.AbortJobRequest, call: Call) -> pb.AbortJobResponse:
        return pb.AbortJobResponse(
            job=job_message(await self._protocol.abort_job(request.job_id, request.reason))
        )

    async def DeleteJob(self, request: pb.DeleteJobRequest, call: Call) -> pb.DeleteJobResponse:
        return pb.DeleteJobResponse(freed_bytes=await self._protocol.delete_job(request.job_id))

    async def WatchJob(self, request: pb.WatchJobRequest, call: Call) -> AsyncIterator[pb.WatchJobResponse]:
        view = await self._protocol.describe_job(request.job_id)  # NOT_FOUND before the stream starts
        state = JOB_STATES[view.job.state]
        async for event in self._protocol.watch_job(request.job_id, after_sequence=request.after_sequence):
            message = event_message(event)
            if message.state:
                state = message.state
            message.state = state
            yield message

    async def ListDevices(self, request: pb.ListDevicesRequest, call: Call) -> pb.ListDevicesResponse:
        state = _DEVICE_STATES_BACK.get(request.state) if request.state else None
        if request.state and state is None:
            raise InvalidArgument(f"unknown device state {request.state}")
        page = await self._protocol.list_devices(
            page_size=min(max(request.page_size, 0), 1000), page_token=request.page_token, state=state
        )
        return pb.ListDevicesResponse(
            devices=[device_message(d) for d in page.items], next_page_token=page.next_page_token
        )

    async def RevokeDevice(self, request: pb.RevokeDeviceRequest, call: Call) -> pb.RevokeDeviceResponse:
        return pb.RevokeDeviceResponse(
            device=device_message(await self._protocol.revoke_device(request.device_id))
        )

    async def ApproveDevice(self, request: pb.ApproveDeviceRequest, call: Call) -> pb.ApproveDeviceResponse:
        if not request.device_id:
            raise InvalidArgument("device_id is required")
        return pb.ApproveDeviceResponse(
            device=device_message(await self._protocol.approve_device(request.device_id))
        )

    async def UploadModel(
        self, requests: AsyncIterator[pb.UploadModelRequest], call: Call
    ) -> pb.UploadModelResponse:
        ref = await receive_stream(self._blobs, requests, max_bytes=self._max_model_bytes)
        response = pb.UploadModelResponse()
        response.model.sha256 = ref.sha256
        response.model.size_bytes = ref.size_bytes
        return response

    async def GetModelUploadStatus(
        self, request: pb.GetModelUploadStatusRequest, call: Call
    ) -> pb.GetModelUploadStatusResponse:
        received, complete = await upload_status(self._blobs, request.sha256)
        return pb.GetModelUploadStatusResponse(received_bytes=received, complete=complete)

    async def DownloadModel(
        self, request: pb.DownloadModelRequest, call: Call
    ) -> AsyncIterator[pb.DownloadModelResponse]:
        if request.round < 0:
            raise InvalidArgument("round must not be negative")
        where = await self._protocol.model_location(request.job_id, request.round)
        async for offset, data, size in send_blob(self._blobs, where.sha256, offset=request.offset):
            yield pb.DownloadModelResponse(
                offset=offset, data=data, size_bytes=size, round=where.round, sha256=where.sha256
            )
