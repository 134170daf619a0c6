"""A FedAvg job end to end on an in-process coordinator, driven by stub-only device clients."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedlink.server.app import Coordinator
from fedlink.server.domain import Task
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import (
    StubDevice,
    dense,
    download_model,
    local_settings,
    read_tensor,
    upload_model,
    weights_dxo,
)


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[Coordinator]:
    async with Coordinator(local_settings(tmp_path)) as c:
        yield c


def _update(device_index: int, round_no: int, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng([device_index, round_no])
    return rng.normal(size=shape).astype(np.float32)


async def _device_loop(device: StubDevice, index: int, rounds_seen: list[tuple[str, int]]) -> None:
    job = await device.get_job()
    while job.status != rpb.RUNNER_STATUS_OK:
        await asyncio.sleep(0.05)
        job = await device.get_job()
    cookie = b""
    while True:
        task = await device.get_task(job.job_id, cookie, wait_s=2)
        if task.status == rpb.RUNNER_STATUS_DONE:
            return
        if task.status != rpb.RUNNER_STATUS_OK:
            continue
        model = {name: read_tensor(t) for name, t in task.task_data.dxo.data.items()}
        round_no = len([r for r in rounds_seen if r[0] == device.device_id]) + 1
        rounds_seen.append((device.device_id, round_no))
        diff = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
        for name, value in model.items():
            diff.data[name].CopyFrom(dense(_update(index, round_no, value.shape)))
        diff.meta["num_examples"].int_value = 10 * (index + 1)
        reply = await device.report(job.job_id, task, diff)
        assert reply.status == rpb.RUNNER_STATUS_OK, reply
        cookie = reply.cookie


async def test_fedavg_two_rounds_gives_the_exact_weighted_average(coordinator: Coordinator) -> None:
    assert coordinator.endpoint is not None
    admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
    initial = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}
    async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
        control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
        devices = [await StubDevice(channel).enroll() for _ in range(3)]
        for device in devices:  # runners ask for work first: only devices that asked are sampled
            await device.get_job()
        sha = await upload_model(control, weights_dxo(initial), admin)
        spec = cpb.JobSpec(name="e2e", initial_model=dxo_pb2.BlobRef(sha256=sha))
        spec.fedavg.num_rounds = 2
        spec.fedavg.seed = 7
        spec.fedavg.round_timeout.FromSeconds(30)
        submitted = await control.SubmitJob(cpb.SubmitJobRequest(spec=spec, request_id="r-1"), metadata=admin)
        job_id = submitted.job.job_id
        seen: list[tuple[str, int]] = []
        index_of = {d.device_id: i for i, d in enumerate(devices)}
        await asyncio.wait_for(
            asyncio.gather(*(_device_loop(d, i, seen) for i, d in enumerate(devices))), timeout=60
        )
        described = await control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=admin)
        assert described.job.state == states_pb2.JOB_STATE_FINISHED, described.job.message
        assert described.job.current_round == 2
        final = await download_model(control, job_id, admin)

    expected = {k: v.copy() for k, v in initial.items()}
    for round_no in (1, 2):
        for name, value in expected.items():
            total = np.zeros(value.shape, np.float64)
            weight = 0.0
            for device_id in sorted(index_of):  # the coordinator's canonical order
                i = index_of[device_id]
                total += _update(i, round_no, value.shape).astype(np.float64) * np.float64(10 * (i + 1))
                weight += 10 * (i + 1)
            expected[name] = (value.astype(np.float64) + total / weight).astype(np.float32)
    for name, value in expected.items():
        got = read_tensor(final.data[name])
        assert got.tobytes() == value.tobytes(), name
    assert sorted(seen) == sorted((d.device_id, r) for d in devices for r in (1, 2))


async def test_a_rounds_tasks_are_known_to_the_device_protocol_before_any_device_asks(
    coordinator: Coordinator,
) -> None:
    assert coordinator.endpoint is not None and coordinator.core is not None
    core = coordinator.core
    admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
    async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
        control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
        devices = [await StubDevice(channel).enroll() for _ in range(3)]
        for device in devices:  # runners ask for work first: only devices that asked are sampled
            await device.get_job()
        sha = await upload_model(control, weights_dxo({"w": np.zeros(4, np.float32)}), admin)
        spec = cpb.JobSpec(name="known", initial_model=dxo_pb2.BlobRef(sha256=sha))
        spec.fedavg.num_rounds = 1
        spec.fedavg.round_timeout.FromSeconds(30)
        submitted = await control.SubmitJob(cpb.SubmitJobRequest(spec=spec, request_id="r-k"), metadata=admin)
        for device in devices:  # seen online (sampling picks among online devices); no task asked for
            offered = await device.get_job("known")
            while offered.status != rpb.RUNNER_STATUS_OK:
                await asyncio.sleep(0.05)
                offered = await device.get_job("known")
        tasks: list[Task] = []
        for _ in range(200):
            try:
                run = await core.store.get_current_run(submitted.job.job_id)
                tasks = list(await core.store.list_tasks(run.run_id, round=1))
            except Exception:  # no run yet
                tasks = []
            if len(tasks) == len(devices):
                break
            await asyncio.sleep(0.05)
    assert len(tasks) == len(devices)
    # The workflow handed its new tasks over as it created them: no device has claimed, so nothing
    # else could have read them in.
    for task in tasks:
        assert core.known_tasks.get(task.task_id) == task
