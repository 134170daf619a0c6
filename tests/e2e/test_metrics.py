"""The Prometheus endpoint of a running coordinator: RPC counts by method and code, domain gauges."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedlink.server.app import Coordinator
from fedlink.server.services.metrics import MetricsCollector
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import StubDevice, dense, local_settings, upload_model, weights_dxo


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[Coordinator]:
    async with Coordinator(local_settings(tmp_path, metrics_address="127.0.0.1:0")) as c:
        yield c


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


async def test_metrics_count_calls_and_follow_the_job(coordinator: Coordinator) -> None:
    assert coordinator.endpoint is not None and coordinator.metrics_url is not None
    assert coordinator.store is not None
    admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
    async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
        control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
        devices = [await StubDevice(channel).enroll() for _ in range(2)]
        for device in devices:  # runners ask for work first: only devices that asked are sampled
            await device.get_job()
        sha = await upload_model(control, weights_dxo({"w": np.zeros(3, np.float32)}), admin)
        spec = cpb.JobSpec(name="metrics", initial_model=dxo_pb2.BlobRef(sha256=sha))
        spec.fedavg.num_rounds = 1
        job = (await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)).job
        first = await devices[0].get_task(job.job_id)
        assert first.status == rpb.RUNNER_STATUS_OK
        diff = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
        diff.data["w"].CopyFrom(dense(np.ones(3, np.float32)))
        diff.meta["num_examples"].int_value = 3
        assert (await devices[0].report(job.job_id, first, diff)).status == rpb.RUNNER_STATUS_OK
        bad = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
        bad.data["w"].CopyFrom(dense(np.ones(4, np.float32)))  # wrong shape: rejected
        bad.meta["num_examples"].int_value = 3
        second = await devices[1].get_task(job.job_id)
        with pytest.raises(grpc.aio.AioRpcError):
            await devices[1].report(job.job_id, second, bad)

        collector = MetricsCollector(coordinator.store, coordinator.telemetry, interval=timedelta(seconds=1))
        await collector.refresh()
        await asyncio.sleep(0.05)  # the server records a call after its reply went out
        samples = await asyncio.to_thread(_scrape, coordinator.metrics_url)

    job_label = f'job_id="{job.job_id}"'
    assert samples['fedlink_devices{state="ONLINE"}'] == 2
    assert samples['fedlink_jobs{state="RUNNING"}'] == 1
    assert samples[f"fedlink_round{{{job_label}}}"] == 1
    assert samples[f"fedlink_round_results{{{job_label}}}"] == 1
    assert samples['fedlink_results_total{outcome="accepted"}'] == 1
    assert samples['fedlink_results_total{outcome="rejected"}'] == 1
    ok = 'fedlink_rpc_requests_total{code="OK",method="ReportResult",service="RunnerService"}'
    invalid = (
        'fedlink_rpc_requests_total{code="INVALID_ARGUMENT",method="ReportResult",service="RunnerService"}'
    )
    assert samples[ok] == 1 and samples[invalid] == 1
    assert samples['fedlink_rpc_requests_total{code="OK",method="Enroll",service="RunnerService"}'] == 2


async def test_metrics_follow_a_fedbuff_jobs_versions_buffer_and_selection(coordinator: Coordinator) -> None:
    assert coordinator.endpoint is not None and coordinator.metrics_url is not None
    assert coordinator.store is not None
    admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
    collector = MetricsCollector(coordinator.store, coordinator.telemetry, interval=timedelta(seconds=1))

    async def gauges(job_id: str) -> dict[str, float]:
        await collector.refresh()
        samples = await asyncio.to_thread(_scrape, coordinator.metrics_url or "")
        names = ("model_version", "buffered_updates", "selection_filled", "selection_size", "round")
        label = f'{{job_id="{job_id}"}}'
        return {n: samples[f"fedlink_{n}{label}"] for n in names if f"fedlink_{n}{label}" in samples}

    def update(value: float) -> dxo_pb2.Dxo:
        diff = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
        diff.data["w"].CopyFrom(dense(np.full(3, value, np.float32)))
        diff.meta["num_examples"].int_value = 1
        return diff

    async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
        control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
        devices = [await StubDevice(channel).enroll() for _ in range(2)]
        for device in devices:
            await device.get_job()
        sha = await upload_model(control, weights_dxo({"w": np.zeros(3, np.float32)}), admin)
        spec = cpb.JobSpec(name="buffered", initial_model=dxo_pb2.BlobRef(sha256=sha))
        spec.fedbuff.max_model_version = 2
        spec.fedbuff.device_selection_size = 2
        spec.fedbuff.num_updates_for_model = 2
        spec.fedbuff.min_hole_to_fill = 2  # a freed slot waits for the other: the fill is seen at 1
        job = (await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)).job
        tasks = [await device.get_task(job.job_id) for device in devices]
        assert [t.status for t in tasks] == [rpb.RUNNER_STATUS_OK] * 2

        assert (await devices[0].report(job.job_id, tasks[0], update(1.0))).status == rpb.RUNNER_STATUS_OK
        first = await gauges(job.job_id)
        assert first == {
            "model_version": 0,
            "buffered_updates": 1,
            "selection_filled": 1,
            "selection_size": 2,
        }

        assert (await devices[1].report(job.job_id, tasks[1], update(2.0))).status == rpb.RUNNER_STATUS_OK
        # The second update makes version 1; both slots are refilled on it (devices are reused).
        tasks = [await device.get_task(job.job_id) for device in devices]
        assert [t.status for t in tasks] == [rpb.RUNNER_STATUS_OK] * 2
        second = await gauges(job.job_id)
        assert second == {
            "model_version": 1,
            "buffered_updates": 0,
            "selection_filled": 2,
            "selection_size": 2,
        }

        for device, task in zip(devices, tasks, strict=True):
            assert (await device.report(job.job_id, task, update(1.0))).status == rpb.RUNNER_STATUS_OK
        watch = control.WatchJob(cpb.WatchJobRequest(job_id=job.job_id), metadata=admin, timeout=30)
        events = [event async for event in watch]  # the stream ends with the job
        assert events[-1].state == states_pb2.JOB_STATE_FINISHED
        assert await gauges(job.job_id) == {}  # a finished job's series are gone
