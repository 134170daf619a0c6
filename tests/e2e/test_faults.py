"""Faults over real gRPC with short leases and deadlines: expired leases and failed results are replaced,
silent devices go offline and are not sampled, and a round short of results is retried or fails the job
with a clear message, never hangs."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import duration_pb2

from fedlink.server.app import Coordinator
from fedlink.server.domain import AssignmentState, DeviceState, ResultStatus
from fedlink.server.settings import CoordinatorSettings
from fedlink.server.store import SqlStateStore
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import Metadata, StubDevice, dense, download_model, read_tensor, upload_model, weights_dxo

MODEL = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
FAST = {"reaper_interval": timedelta(milliseconds=100)}


@dataclass(slots=True, kw_only=True)
class Fleet:
    """A coordinator, its admin stub and enrolled stub devices."""

    coordinator: Coordinator
    control: cgrpc.ControlServiceAsyncStub
    admin: Metadata
    devices: list[StubDevice]
    model_sha: str

    @property
    def store(self) -> SqlStateStore:
        assert self.coordinator.store is not None
        return self.coordinator.store

    async def submit(self, **fedavg: Any) -> str:
        spec = cpb.JobSpec(name="faults", initial_model=dxo_pb2.BlobRef(sha256=self.model_sha))
        spec.fedavg.CopyFrom(cpb.FedAvgConfig(**{"num_rounds": 1, "seed": 3, **fedavg}))
        request = cpb.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4()))
        return (await self.control.SubmitJob(request, metadata=self.admin)).job.job_id

    async def job(self, job_id: str) -> cpb.Job:
        return (
            await self.control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=self.admin)
        ).job

    async def wait_final(self, job_id: str) -> cpb.Job:
        """Polls until the job is final; bounded, so a hang fails the test instead of stalling it."""
        final = (states_pb2.JOB_STATE_FINISHED, states_pb2.JOB_STATE_FAILED, states_pb2.JOB_STATE_ABORTED)
        for _ in range(400):
            job = await self.job(job_id)
            if job.state in final:
                return job
            await asyncio.sleep(0.05)
        raise AssertionError(f"job {job_id} is still {states_pb2.JobState.Name(job.state)} after 20 s")


def coordinator_settings(tmp_path: Path, **settings: Any) -> CoordinatorSettings:
    """A plaintext coordinator with open enrolment on a free port, its data in ``tmp_path/data``."""
    return CoordinatorSettings(
        data_dir=tmp_path / "data",
        listen_address="127.0.0.1:0",
        insecure=True,
        open_enrolment=True,
        **settings,
    )


@asynccontextmanager
async def fleet(tmp_path: Path, size: int, **settings: Any) -> AsyncIterator[Fleet]:
    async with Coordinator(coordinator_settings(tmp_path, **settings)) as coordinator:
        assert coordinator.endpoint is not None
        admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
            devices = [await StubDevice(channel).enroll() for _ in range(size)]
            for device in devices:  # runners ask for work first: only devices that asked are sampled
                await device.get_job()
            sha = await upload_model(control, weights_dxo(MODEL), admin)
            yield Fleet(coordinator=coordinator, control=control, admin=admin, devices=devices, model_sha=sha)


def update(device: StubDevice, num_examples: int) -> dxo_pb2.Dxo:
    """A WEIGHT_DIFF distinct per device."""
    rng = np.random.default_rng(list(device.device_id.encode()))
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    dxo.data["w"].CopyFrom(dense(rng.normal(size=(2, 3)).astype(np.float32)))
    dxo.meta["num_examples"].int_value = num_examples
    return dxo


def expected_model(updates: dict[str, dxo_pb2.Dxo]) -> np.ndarray:
    """MODEL['w'] plus the weighted mean of the updates, in device-id order as the coordinator sums."""
    total, weight = np.zeros((2, 3), np.float64), 0.0
    for device_id in sorted(updates):
        dxo = updates[device_id]
        w = float(dxo.meta["num_examples"].int_value)
        total += read_tensor(dxo.data["w"]).astype(np.float64) * np.float64(w)
        weight += w
    return (MODEL["w"].astype(np.float64) + total / weight).astype(np.float32)


async def sampled(
    devices: list[StubDevice], job_id: str, count: int = 2
) -> tuple[dict[str, rpb.GetTaskResponse], list[StubDevice]]:
    """The ``count`` devices the first round handed a task to (with their tasks), and the others."""
    tasks: dict[str, rpb.GetTaskResponse] = {}
    for _ in range(40):
        for device in devices:
            if device.device_id not in tasks:
                task = await device.get_task(job_id, wait_s=0.1)
                if task.status == rpb.RUNNER_STATUS_OK:
                    tasks[device.device_id] = task
        if len(tasks) >= count:
            break
    idle = [d for d in devices if d.device_id not in tasks]
    return tasks, idle


async def take_task(device: StubDevice, job_id: str) -> rpb.GetTaskResponse:
    for _ in range(20):
        task = await device.get_task(job_id, wait_s=1)
        if task.status == rpb.RUNNER_STATUS_OK:
            return task
    raise AssertionError(f"device {device.device_id} was never handed a task")


async def test_an_expired_lease_goes_to_another_device(tmp_path: Path) -> None:
    async with fleet(tmp_path, 3, lease=timedelta(seconds=2), **FAST) as f:
        job_id = await f.submit(devices_per_round=2, min_results=2, round_timeout=_seconds(30))
        tasks, idle = await sampled(f.devices, job_id)
        assert len(tasks) == 2 and len(idle) == 1, tasks
        by_id = {d.device_id: d for d in f.devices}
        silent_id, worker_id = sorted(tasks)
        worker, replacement = by_id[worker_id], idle[0]
        updates = {worker_id: update(worker, 40), replacement.device_id: update(replacement, 60)}
        assert (
            await worker.report(job_id, tasks[worker_id], updates[worker_id])
        ).status == rpb.RUNNER_STATUS_OK
        # The silent device never reports; once its lease ends its share goes to the idle device.
        task = await take_task(replacement, job_id)
        reply = await replacement.report(job_id, task, updates[replacement.device_id])
        assert reply.status == rpb.RUNNER_STATUS_OK
        job = await f.wait_final(job_id)
        assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
        silent = await f.store.get_assignment(tasks[silent_id].assignment_id)
        assert silent.state is AssignmentState.EXPIRED
        late = await by_id[silent_id].report(job_id, tasks[silent_id], update(by_id[silent_id], 1000))
        assert late.status == rpb.RUNNER_STATUS_DONE  # recorded, not aggregated
        final = await download_model(f.control, job_id, f.admin)
        assert read_tensor(final.data["w"]).tobytes() == expected_model(updates).tobytes()


async def test_a_failed_result_frees_its_slot_and_keeps_its_reason(tmp_path: Path) -> None:
    async with fleet(tmp_path, 3, **FAST) as f:
        job_id = await f.submit(devices_per_round=2, min_results=2, round_timeout=_seconds(30))
        tasks, idle = await sampled(f.devices, job_id)
        assert len(tasks) == 2 and len(idle) == 1, tasks
        by_id = {d.device_id: d for d in f.devices}
        failing_id, worker_id = sorted(tasks)
        worker, replacement = by_id[worker_id], idle[0]
        failure = rpb.ReportResultRequest(
            job_id=job_id,
            task_id=tasks[failing_id].task_id,
            cookie=tasks[failing_id].cookie,
            status=states_pb2.RESULT_STATUS_FAILED,
            error_message="ValueError: the local dataset is empty",
            request_id=str(uuid.uuid4()),
        )
        failing = by_id[failing_id]
        assert (
            await failing.stub.ReportResult(failure, metadata=failing.metadata)
        ).status == rpb.RUNNER_STATUS_OK
        task = await take_task(replacement, job_id)  # the freed slot, offered to a device not yet asked
        updates = {worker_id: update(worker, 25), replacement.device_id: update(replacement, 75)}
        for device, held in ((worker, tasks[worker_id]), (replacement, task)):
            reply = await device.report(job_id, held, updates[device.device_id])
            assert reply.status == rpb.RUNNER_STATUS_OK
        job = await f.wait_final(job_id)
        assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
        run = await f.store.get_current_run(job_id)
        results = await f.store.list_results(run_id=run.run_id, accepted_only=False)
        failed = [r for r in results if r.device_id == failing_id]
        assert len(failed) == 1
        assert failed[0].status is ResultStatus.FAILED and not failed[0].accepted
        assert failed[0].error_message == "ValueError: the local dataset is empty"
        assert (await f.store.get_assignment(tasks[failing_id].assignment_id)).state is AssignmentState.FAILED
        final = await download_model(f.control, job_id, f.admin)
        assert read_tensor(final.data["w"]).tobytes() == expected_model(updates).tobytes()


async def test_a_device_that_stops_polling_goes_offline_and_is_not_sampled(tmp_path: Path) -> None:
    # The online window must cover a polling device's cadence (max_task_wait + job_retry_after).
    quick = {"max_task_wait": timedelta(milliseconds=500), "default_task_wait": timedelta(milliseconds=500)}
    quick |= {"job_retry_after": timedelta(milliseconds=200)}
    async with fleet(tmp_path, 3, device_offline_after=timedelta(seconds=1), **quick, **FAST) as f:
        active, quiet = f.devices[:2], f.devices[2]
        stop = asyncio.Event()

        async def keep_polling(device: StubDevice) -> None:
            while not stop.is_set():
                await device.get_job()
                await asyncio.sleep(0.1)

        pollers = [asyncio.create_task(keep_polling(d)) for d in active]
        try:
            for _ in range(100):  # the quiet device says nothing; the others keep calling
                if (await f.store.get_device(quiet.device_id)).state is DeviceState.OFFLINE:
                    break
                await asyncio.sleep(0.1)
            listed = await f.control.ListDevices(cpb.ListDevicesRequest(), metadata=f.admin)
            states = {d.device_id: d.state for d in listed.devices}
            assert states[quiet.device_id] == states_pb2.DEVICE_STATE_OFFLINE
            assert all(states[d.device_id] == states_pb2.DEVICE_STATE_ONLINE for d in active)
            job_id = await f.submit(fraction=1.0, min_devices=2, round_timeout=_seconds(30))
            updates = {d.device_id: update(d, 10 * (i + 1)) for i, d in enumerate(active)}
            for device in active:
                task = await take_task(device, job_id)
                assert (
                    await device.report(job_id, task, updates[device.device_id])
                ).status == rpb.RUNNER_STATUS_OK
            job = await f.wait_final(job_id)
        finally:
            stop.set()
            await asyncio.gather(*pollers)
        assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
        run = await f.store.get_current_run(job_id)
        task_ids = [t.task_id for t in await f.store.list_tasks(run.run_id)]
        targets = await f.store.task_targets(task_ids=task_ids)
        asked = {d for devices in targets.values() for d in devices}
        assert asked == {d.device_id for d in active}
        final = await download_model(f.control, job_id, f.admin)
        assert read_tensor(final.data["w"]).tobytes() == expected_model(updates).tobytes()


@pytest.mark.parametrize(
    ("policy", "retries"), [(cpb.ROUND_FAILURE_POLICY_FAIL, 2), (cpb.ROUND_FAILURE_POLICY_RETRY, 0)]
)
async def test_a_round_short_of_results_fails_the_job_with_a_clear_message(
    tmp_path: Path, policy: int, retries: int
) -> None:
    async with fleet(tmp_path, 2, **FAST) as f:
        job_id = await f.submit(
            min_results=2,
            min_devices=2,
            round_timeout=_seconds(2),
            round_failure_policy=policy,
            max_round_retries=retries,
        )
        worker, silent = f.devices
        task = await take_task(worker, job_id)
        await take_task(silent, job_id)  # and never reports
        assert (await worker.report(job_id, task, update(worker, 5))).status == rpb.RUNNER_STATUS_OK
        job = await f.wait_final(job_id)
        assert job.state == states_pb2.JOB_STATE_FAILED
        assert "round 1" in job.message and "1 of the 2 results" in job.message, job.message
        assert (await silent.get_task(job_id, wait_s=0.1)).status == rpb.RUNNER_STATUS_DONE


async def test_a_round_short_of_results_is_retried_with_other_devices(tmp_path: Path) -> None:
    async with fleet(tmp_path, 3, **FAST) as f:
        job_id = await f.submit(
            devices_per_round=2,
            min_results=2,
            round_timeout=_seconds(2),
            round_failure_policy=cpb.ROUND_FAILURE_POLICY_RETRY,
            max_round_retries=1,
        )
        tasks, idle = await sampled(f.devices, job_id)
        assert len(tasks) == 2 and len(idle) == 1, tasks
        by_id = {d.device_id: d for d in f.devices}
        worker_id, silent_id = sorted(tasks)
        worker, newcomer = by_id[worker_id], idle[0]
        updates = {worker_id: update(worker, 30), newcomer.device_id: update(newcomer, 70)}
        assert (
            await worker.report(job_id, tasks[worker_id], updates[worker_id])
        ).status == rpb.RUNNER_STATUS_OK
        # The deadline passes one result short; the retry asks the devices that have not delivered.
        task = await take_task(newcomer, job_id)
        assert (
            await newcomer.report(job_id, task, updates[newcomer.device_id])
        ).status == rpb.RUNNER_STATUS_OK
        job = await f.wait_final(job_id)
        assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
        final = await download_model(f.control, job_id, f.admin)
        assert read_tensor(final.data["w"]).tobytes() == expected_model(updates).tobytes()
        assert silent_id not in updates


def _seconds(value: int) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=value)


async def test_a_restarted_coordinator_grants_a_round_no_more_retries_than_its_job_allows(
    tmp_path: Path,
) -> None:
    allowed = {"round_failure_policy": cpb.ROUND_FAILURE_POLICY_RETRY, "max_round_retries": 1}
    async with fleet(tmp_path, 2, **FAST) as f:
        job_id = await f.submit(devices_per_round=2, min_results=2, round_timeout=_seconds(1), **allowed)
        for _ in range(200):  # nobody reports: the round falls short and is handed out once more
            job = await f.job(job_id)
            if job.state == states_pb2.JOB_STATE_RUNNING:
                run = await f.store.get_current_run(job_id)
                if len(await f.store.list_tasks(run.run_id, round=1)) == 4:
                    break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the round was not retried")
        assert await f.store.round_retries(run_id=run.run_id, round=1, name="train") == 1
    # Stopped during its one allowed retry; started again on the same data directory and database.
    async with Coordinator(coordinator_settings(tmp_path, **FAST)) as again:
        assert again.store is not None
        for _ in range(200):
            resumed = await again.store.get_job(job_id)
            if resumed.state.value in ("FAILED", "FINISHED", "ABORTED"):
                break
            await asyncio.sleep(0.05)
        # The retry wave falls short too: the job fails instead of retrying the round once more.
        assert resumed.state.value == "FAILED", resumed
        assert "round 1 got 0 of the 2 results" in resumed.message, resumed.message
        assert len(await again.store.list_tasks(run.run_id, round=1)) == 4
        assert await again.store.round_retries(run_id=run.run_id, round=1, name="train") == 2
