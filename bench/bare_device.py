"""A device that speaks RunnerService through the generated stubs and nothing else.

The runner benchmark's floor: the two RPCs a task needs and the coordinator's round boundary, with
no filters, no executor thread, no durable pending write and no DXO encoding (the result is prebuilt).
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc

from bench.runner_probes import TaskTimes
from fedlink.common.version import PROTOCOL_VERSION
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb
from fedlink.v1 import runner_service_pb2_grpc as rgrpc

__all__ = ["bare_device_tasks"]

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024**2),
    ("grpc.max_receive_message_length", 64 * 1024**2),
]


async def bare_device_tasks(
    address: str, job_name: str, rounds: int, result: dxo_pb2.Dxo
) -> tuple[list[TaskTimes], int]:
    """Enrols, finds the job, then GetTask → ReportResult with a prebuilt result for ``rounds`` tasks.

    Returns:
        Each task's marks (GetTask sent and answered, ReportResult sent and answered, the ack's
        status name) and the size of the last ReportResult request in bytes.
    """
    times: list[TaskTimes] = []
    report_bytes = 0
    async with grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS) as channel:
        stub = rgrpc.RunnerServiceStub(channel)
        enrolled = await stub.Enroll(
            rpb.EnrollRequest(
                protocol_version=PROTOCOL_VERSION, request_id=str(uuid.uuid4()), device_info={"bench": "bare"}
            )
        )
        metadata = (("authorization", f"Bearer {enrolled.device_credential}"),)
        while True:
            job = await stub.GetJob(
                rpb.GetJobRequest(
                    job_name=job_name, protocol_version=PROTOCOL_VERSION, device_info={"bench": "bare"}
                ),
                metadata=metadata,
            )
            if job.status == rpb.RUNNER_STATUS_OK:
                break
            await asyncio.sleep(0.05)
        cookie = b""
        while len(times) < rounds:
            request = rpb.GetTaskRequest(job_id=job.job_id, cookie=cookie)
            request.wait_timeout.FromSeconds(20)
            start = time.perf_counter()
            offer = await stub.GetTask(request, metadata=metadata, timeout=50)
            end = time.perf_counter()
            cookie = offer.cookie or cookie
            if offer.status == rpb.RUNNER_STATUS_RETRY:
                continue
            if offer.status != rpb.RUNNER_STATUS_OK:
                break
            task = TaskTimes(offer.task_id, get_start=start, get_end=end)
            report = rpb.ReportResultRequest(
                job_id=job.job_id,
                task_id=offer.task_id,
                cookie=offer.cookie,
                request_id=str(uuid.uuid4()),
                status=states_pb2.RESULT_STATUS_SUCCEEDED,
            )
            report.result.dxo.CopyFrom(result)
            report_bytes = report.ByteSize()
            task.report_start = time.perf_counter()
            ack = await stub.ReportResult(report, metadata=metadata, timeout=30)
            task.report_end = time.perf_counter()
            task.ack = rpb.RunnerStatus.Name(ack.status)
            cookie = ack.cookie or cookie
            times.append(task)
    return times, report_bytes
