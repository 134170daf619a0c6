"""FedBuff over the wire API: submitted as FedBuffConfig, described with every parameter written out,
run by devices written against the generated stubs only, its model versions watched as events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedlink.server.app import Coordinator
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

DEVICES = 4
VERSIONS = 3


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[Coordinator]:
    async with Coordinator(local_settings(tmp_path)) as c:
        yield c


def _spec(sha: str) -> cpb.JobSpec:
    spec = cpb.JobSpec(name="wire-fedbuff", initial_model=dxo_pb2.BlobRef(sha256=sha))
    spec.fedbuff.max_model_version = VERSIONS
    spec.fedbuff.device_selection_size = 3
    spec.fedbuff.num_updates_for_model = 2
    spec.fedbuff.max_model_history = 2
    spec.fedbuff.global_lr = 0.5
    spec.fedbuff.staleness_weight = True
    spec.fedbuff.update_weight = cpb.UPDATE_WEIGHT_DEVICE
    spec.fedbuff.device_sampling_strategy = cpb.DEVICE_SAMPLING_STRATEGY_RANDOM
    spec.fedbuff.task_timeout.FromSeconds(120)
    spec.fedbuff.seed = 4
    return spec


async def _device(device: StubDevice, index: int, seen: list[tuple[int, int]]) -> None:
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
        seen.append((task.round, task.model_version))  # a FedBuff task's round is its model's version
        diff = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
        for name, tensor in task.task_data.dxo.data.items():
            step = np.random.default_rng([index, task.model_version]).normal(size=read_tensor(tensor).shape)
            diff.data[name].CopyFrom(dense((step * 0.1).astype(np.float32)))
        diff.meta["num_examples"].int_value = 10 * (index + 1)
        reply = await device.report(job.job_id, task, diff)
        assert reply.status in (rpb.RUNNER_STATUS_OK, rpb.RUNNER_STATUS_STALE, rpb.RUNNER_STATUS_DONE), reply
        cookie = reply.cookie


async def test_fedbuff_runs_over_the_wire_and_is_described_and_watched(coordinator: Coordinator) -> None:
    assert coordinator.endpoint is not None
    admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
    initial = {"w": np.full((2, 3), 0.5, np.float32), "b": np.zeros(3, np.float32)}
    async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
        control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
        devices = [await StubDevice(channel).enroll() for _ in range(DEVICES)]
        sha = await upload_model(control, weights_dxo(initial), admin)
        submitted = await control.SubmitJob(cpb.SubmitJobRequest(spec=_spec(sha)), metadata=admin)
        job_id = submitted.job.job_id
        seen: list[tuple[int, int]] = []
        await asyncio.wait_for(asyncio.gather(*(_device(d, i, seen) for i, d in enumerate(devices))), 60)
        job = (await control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=admin)).job
        events = [e async for e in control.WatchJob(cpb.WatchJobRequest(job_id=job_id), metadata=admin)]
        final = await download_model(control, job_id, admin)

    assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
    assert (job.current_round, job.completed_rounds) == (VERSIONS, VERSIONS)
    assert job.spec.WhichOneof("workflow") == "fedbuff"
    described = job.spec.fedbuff
    assert (described.max_model_version, described.device_selection_size) == (VERSIONS, 3)
    assert (described.num_updates_for_model, described.max_model_history, described.seed) == (2, 2, 4)
    assert described.global_lr == pytest.approx(0.5) and described.staleness_weight
    assert described.update_weight == cpb.UPDATE_WEIGHT_DEVICE
    assert described.device_sampling_strategy == cpb.DEVICE_SAMPLING_STRATEGY_RANDOM
    assert described.task_timeout.ToSeconds() == 120
    # left out, written out: the defaults that ran
    assert described.HasField("min_hole_to_fill") and described.min_hole_to_fill == 1
    assert described.HasField("device_reuse") and described.device_reuse
    assert described.pickup_timeout.ToSeconds() == 30 and described.keep_checkpoints == 3
    assert not described.HasField("device_wait_timeout")  # zero: waits for ever

    versions = [e for e in events if e.WhichOneof("event") == "model_version"]
    assert [e.round for e in versions] == [1, 2, 3]
    for event in versions:
        assert event.model_version.num_updates >= 2
        assert sum(event.model_version.staleness_counts) == event.model_version.num_updates
        assert event.model_version.metrics["num_updates"] == event.model_version.num_updates
    assert all(r == v for r, v in seen)  # tasks carry the version current when handed out
    assert {v for _, v in seen} >= {0, 1, 2}
    moved = {k: read_tensor(t) for k, t in final.data.items()}
    assert any(not np.array_equal(moved[k], initial[k]) for k in initial)


async def test_bad_fedbuff_parameters_get_invalid_argument_naming_them(coordinator: Coordinator) -> None:
    assert coordinator.endpoint is not None
    admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
    async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
        control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
        sha = await upload_model(control, weights_dxo({"w": np.zeros(3, np.float32)}), admin)
        cases = [
            ("min_hole_to_fill", 9, "fedbuff.min_hole_to_fill cannot exceed device_selection_size"),
            ("max_model_version", 0, "fedbuff.max_model_version must be at least 1"),
            ("global_lr", -1.0, "fedbuff.global_lr must be a positive number"),
            ("update_weight", 7, "unknown update_weight 7"),
        ]
        for key, value, message in cases:
            spec = _spec(sha)
            setattr(spec.fedbuff, key, value)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, key
            assert message in str(refused.value.details()), refused.value.details()
