"""Devices that went away do not hold rounds: a sampled device that does not pick up its task within
the pickup timeout is replaced by another eligible device, without waiting for the round's timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedlink.server.app import Coordinator
from fedlink.server.workflows.fedavg import sample_devices
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import StubDevice, dense, local_settings, read_tensor, upload_model, weights_dxo

ROUND_TIMEOUT_S = 60
PICKUP_TIMEOUT_S = 1


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[Coordinator]:
    async with Coordinator(local_settings(tmp_path)) as c:
        yield c


async def _train(device: StubDevice, job_id: str) -> int:
    """Answers every task of the job with a difference of ones; returns how many it did."""
    cookie, done = b"", 0
    while True:
        task = await device.get_task(job_id, cookie, wait_s=2)
        if task.status == rpb.RUNNER_STATUS_DONE:
            return done
        if task.status != rpb.RUNNER_STATUS_OK:
            continue
        diff = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
        for name, tensor in task.task_data.dxo.data.items():
            diff.data[name].CopyFrom(dense(np.ones_like(read_tensor(tensor))))
        diff.meta["num_examples"].int_value = 1
        reply = await device.report(job_id, task, diff)
        assert reply.status == rpb.RUNNER_STATUS_OK, reply
        cookie, done = reply.cookie, done + 1


async def test_a_sampled_device_that_never_picks_up_is_replaced_after_the_pickup_timeout(
    coordinator: Coordinator,
) -> None:
    assert coordinator.endpoint is not None
    admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
    async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
        control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
        live = [await StubDevice(channel).enroll() for _ in range(2)]
        gone = [await StubDevice(channel).enroll() for _ in range(2)]
        for device in gone:  # polled once, then went away without a word (killed, unplugged)
            assert (await device.get_job()).status == rpb.RUNNER_STATUS_NO_JOB
        everyone = sorted(d.device_id for d in live + gone)
        gone_ids = {d.device_id for d in gone}
        # A seed whose sample of two includes a device that went away: the round must replace it.
        seed = next(
            s for s in range(100) if gone_ids & set(sample_devices(everyone, 2, seed=s, round=1, wave=0))
        )
        spec = cpb.JobSpec(name="liveness", initial_model=dxo_pb2.BlobRef(sha256=""))
        spec.initial_model.sha256 = await upload_model(
            control, weights_dxo({"w": np.zeros(3, np.float32)}), admin
        )
        spec.fedavg.num_rounds = 1
        spec.fedavg.devices_per_round = 2
        spec.fedavg.seed = seed
        spec.fedavg.round_timeout.FromSeconds(ROUND_TIMEOUT_S)
        spec.fedavg.pickup_timeout.FromSeconds(PICKUP_TIMEOUT_S)
        job_id = (await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)).job.job_id
        started = time.monotonic()
        for device in live:
            assert (await device.get_job()).job_id == job_id
        done = await asyncio.wait_for(asyncio.gather(*(_train(d, job_id) for d in live)), ROUND_TIMEOUT_S / 2)
        took = time.monotonic() - started
        job = (await control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=admin)).job
        described = job.spec.fedavg.pickup_timeout.ToTimedelta().total_seconds()

    assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
    assert done == [1, 1]  # the live devices did the round; the replaced device's slot went to one
    assert took < ROUND_TIMEOUT_S / 2  # not held until the round's timeout
    assert described == PICKUP_TIMEOUT_S
