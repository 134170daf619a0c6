"""Devices that went away do not hold rounds.

* A sampled device that does not pick up its task within the pickup timeout is replaced by another
  eligible device, without waiting for the round's timeout.
* A runner that stops (session done, stop(), SIGTERM) signs off: it is not sampled until it calls
  again, and what it held is released at once.
* Only devices that asked for work of the job's name (or any job) are sampled: enrolled devices that
  never poll, and devices that run another job only, never get a round.
* Online means a call within a window derived from the long-poll cadence: seconds, not minutes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from fedlink.common.errors import InvalidArgument
from fedlink.runner.data import NpzDataSource
from fedlink.runner.loop import Runner
from fedlink.runner.transport.backoff import Backoff
from fedlink.runner.transport.grpc_transport import GrpcTransport, GrpcTransportConfig
from fedlink.server.app import Coordinator
from fedlink.server.domain import AssignmentState, DeviceState
from fedlink.server.settings import CoordinatorSettings
from fedlink.server.store import SqlStateStore
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


async def test_a_late_device_with_nobody_to_replace_it_keeps_its_task(coordinator: Coordinator) -> None:
    # Every device is in the round, so a late one has no replacement: closing its task at the pickup
    # timeout would leave the round short until its deadline. It keeps the task and the round closes
    # with its result as soon as it reports.
    assert coordinator.endpoint is not None
    admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
    async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
        control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
        devices = [await StubDevice(channel).enroll() for _ in range(3)]
        for device in devices:
            assert (await device.get_job()).status == rpb.RUNNER_STATUS_NO_JOB
        spec = cpb.JobSpec(name="liveness", initial_model=dxo_pb2.BlobRef(sha256=""))
        spec.initial_model.sha256 = await upload_model(
            control, weights_dxo({"w": np.zeros(3, np.float32)}), admin
        )
        spec.fedavg.num_rounds = 1
        spec.fedavg.devices_per_round = 3
        spec.fedavg.round_timeout.FromSeconds(ROUND_TIMEOUT_S)
        spec.fedavg.pickup_timeout.FromSeconds(PICKUP_TIMEOUT_S)
        job_id = (await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)).job.job_id
        started = time.monotonic()
        *prompt, late = devices
        for device in devices:
            assert (await device.get_job()).job_id == job_id

        async def late_train() -> int:
            await asyncio.sleep(3 * PICKUP_TIMEOUT_S)  # well past its pickup timeout
            return await _train(late, job_id)

        done = await asyncio.wait_for(
            asyncio.gather(*(_train(d, job_id) for d in prompt), late_train()), ROUND_TIMEOUT_S / 2
        )
        took = time.monotonic() - started
        job = (await control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=admin)).job

    assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
    assert done == [1, 1, 1]  # the late device's task was still its own
    assert took < ROUND_TIMEOUT_S / 2  # the round did not wait for its deadline


# ---- sign-offs, polls and the online window ------------------------------------------------------

#: Long enough that a round waiting for a device that went away would blow the test's time bound.
LONG_PICKUP_S = 60
#: Short polling, so that the tests' runners and stubs come and go in a second.
FAST_POLLING: dict[str, Any] = {
    "max_task_wait": timedelta(seconds=1),
    "default_task_wait": timedelta(seconds=1),
    "job_retry_after": timedelta(milliseconds=200),
    "reaper_interval": timedelta(milliseconds=100),
}
FEATURES, CLASSES = 4, 3


def _spec(control_sha: str, *, name: str = "liveness", rounds: int = 1, **fedavg: Any) -> cpb.JobSpec:
    spec = cpb.JobSpec(name=name, initial_model=dxo_pb2.BlobRef(sha256=control_sha))
    spec.fedavg.CopyFrom(cpb.FedAvgConfig(num_rounds=rounds, seed=1, **fedavg))
    spec.fedavg.round_timeout.FromSeconds(120)
    spec.fedavg.pickup_timeout.FromSeconds(LONG_PICKUP_S)
    return spec


async def _wait_final(
    control: cgrpc.ControlServiceAsyncStub, admin: Any, job_id: str, bound_s: float
) -> cpb.Job:
    """The job once it is final; fails the test if that takes longer than ``bound_s``."""
    final = (states_pb2.JOB_STATE_FINISHED, states_pb2.JOB_STATE_FAILED, states_pb2.JOB_STATE_ABORTED)
    deadline = time.monotonic() + bound_s
    while True:
        job = (await control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=admin)).job
        if job.state in final:
            return job
        assert time.monotonic() < deadline, (
            f"job still {states_pb2.JobState.Name(job.state)} after {bound_s}s"
        )
        await asyncio.sleep(0.05)


async def _targets(store: SqlStateStore, job_id: str) -> set[str]:
    """Every device any task of the job was handed to."""
    run = await store.get_current_run(job_id)
    task_ids = [t.task_id for t in await store.list_tasks(run.run_id)]
    return {d for devices in (await store.task_targets(task_ids=task_ids)).values() for d in devices}


async def _eligible(store: SqlStateStore, job_name: str, expected: int) -> set[str]:
    """The devices sampling would pick from, once there are ``expected`` of them (bounded wait)."""
    for _ in range(200):
        ids = {d for d, _ in await store.online_devices(with_info=False, job_name=job_name)}
        if len(ids) >= expected:
            return ids
        await asyncio.sleep(0.05)
    raise AssertionError(f"only {len(ids)} devices are eligible for {job_name!r}, not {expected}")


def _npz(directory: Path, index: int) -> Path:
    rng = np.random.default_rng(index)
    path = directory / f"data-{index}.npz"
    np.savez(
        path,
        x_train=rng.normal(size=(24, FEATURES)).astype(np.float32),
        y_train=rng.integers(0, CLASSES, size=24),
    )
    return path


def _runner(address: str, state_dir: Path, data: Path) -> Runner:
    transport = GrpcTransport(
        GrpcTransportConfig(
            server=address,
            state_dir=state_dir,
            insecure=True,
            task_wait=timedelta(seconds=1),
            per_request=timedelta(seconds=5),
            backoff=Backoff(base=timedelta(milliseconds=50), cap=timedelta(milliseconds=500)),
        )
    )
    return Runner("", NpzDataSource(data), {"platform": "test"}, {}, 600, transport=transport)


async def _stopped(runners: Sequence[Runner], tasks: Sequence[asyncio.Task[None]]) -> None:
    for runner in runners:
        runner.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)


async def test_two_of_four_runners_stop_and_the_job_runs_on_the_other_two_without_a_stall(
    tmp_path: Path,
) -> None:
    async with Coordinator(local_settings(tmp_path, **FAST_POLLING)) as coordinator:
        assert coordinator.endpoint is not None and coordinator.store is not None
        store, address = coordinator.store, coordinator.endpoint.address
        admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
        runners = [_runner(address, tmp_path / f"runner-{i}", _npz(tmp_path, i)) for i in range(4)]
        tasks = [asyncio.create_task(r.run_async()) for r in runners]
        try:
            await _eligible(store, "liveness", 4)  # all four polled for work
            live, gone = runners[:2], runners[2:]
            await _stopped(gone, tasks[2:])  # they end their sessions and sign off
            gone_ids = {r.transport.device_id for r in gone}
            live_ids = {r.transport.device_id for r in live}
            for device_id in gone_ids:  # at once, not after the online window
                assert (await store.get_device(device_id)).state is DeviceState.OFFLINE
            async with grpc.aio.insecure_channel(address) as channel:
                control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
                model = {
                    "weight": np.zeros((FEATURES, CLASSES), np.float32),
                    "bias": np.zeros(CLASSES, np.float32),
                }
                spec = _spec(await upload_model(control, weights_dxo(model), admin), rounds=2)
                spec.job_data = json.dumps(
                    {
                        "components": [
                            {"type": "SoftmaxRegressionTrainer", "name": "trainer", "args": {"epochs": 1}}
                        ],
                        "executors": {"*": "@trainer"},
                    }
                )
                started = time.monotonic()
                request = cpb.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4()))
                job_id = (await control.SubmitJob(request, metadata=admin)).job.job_id
                job = await _wait_final(control, admin, job_id, LONG_PICKUP_S / 2)
                took = time.monotonic() - started
            assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
            assert job.current_round == 2
            assert await _targets(store, job_id) == live_ids  # the stopped runners were never sampled
            assert took < LONG_PICKUP_S / 2  # no round waited for a pickup that could not come
        finally:
            await _stopped(runners, tasks)


async def test_fifty_enrolled_but_silent_devices_do_not_make_a_job_fail(tmp_path: Path) -> None:
    async with Coordinator(local_settings(tmp_path, **FAST_POLLING)) as coordinator:
        assert coordinator.endpoint is not None and coordinator.store is not None
        admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
            silent = [await StubDevice(channel).enroll() for _ in range(50)]  # ONLINE: just enrolled
            live = [await StubDevice(channel).enroll() for _ in range(2)]
            for device in live:  # idle runners ask for a job until there is one
                assert (await device.get_job()).status == rpb.RUNNER_STATUS_NO_JOB
            sha = await upload_model(control, weights_dxo({"w": np.zeros(3, np.float32)}), admin)
            spec = _spec(sha, rounds=2, devices_per_round=10, max_round_retries=0)
            spec.fedavg.pickup_timeout.FromSeconds(2)  # even a short one would fail the job if silent
            started = time.monotonic()
            job_id = (await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)).job.job_id
            for device in live:
                assert (await device.get_job()).job_id == job_id
            done = await asyncio.wait_for(asyncio.gather(*(_train(d, job_id) for d in live)), 30)
            job = await _wait_final(control, admin, job_id, 30)
            took = time.monotonic() - started
        store = coordinator.store
        assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
        assert done == [2, 2]
        assert await _targets(store, job_id) == {d.device_id for d in live}
        assert not {d.device_id for d in silent} & await _targets(store, job_id)
        assert took < 10  # never waited out a pickup timeout for a silent device


async def test_a_device_that_signs_off_with_a_task_gives_it_back_and_is_not_sampled_again(
    tmp_path: Path,
) -> None:
    async with Coordinator(local_settings(tmp_path, **FAST_POLLING)) as coordinator:
        assert coordinator.endpoint is not None and coordinator.store is not None
        store = coordinator.store
        admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
            devices = [await StubDevice(channel).enroll() for _ in range(3)]
            for device in devices:
                await device.get_job()
            everyone = sorted(d.device_id for d in devices)
            sha = await upload_model(control, weights_dxo({"w": np.zeros(3, np.float32)}), admin)
            spec = _spec(sha, devices_per_round=2, min_results=2)
            sampled = set(sample_devices(everyone, 2, seed=1, round=1, wave=0))
            leaving = next(d for d in devices if d.device_id in sampled)
            staying = [d for d in devices if d is not leaving]
            started = time.monotonic()
            job_id = (await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)).job.job_id
            held = await leaving.get_task(job_id, wait_s=5)
            assert held.status == rpb.RUNNER_STATUS_OK
            reply = await leaving.stub.SignOff(
                rpb.SignOffRequest(reason="SIGTERM", request_id=str(uuid.uuid4())), metadata=leaving.metadata
            )
            assert (reply.status, reply.released_assignments) == (rpb.RUNNER_STATUS_OK, 1)
            assignment = await store.get_assignment(held.assignment_id)
            assert assignment.state is AssignmentState.RELEASED
            assert (await store.get_device(leaving.device_id)).state is DeviceState.OFFLINE
            # Its task goes to the device that was not sampled, now, not after the lease or pickup timeout.
            done = await asyncio.wait_for(asyncio.gather(*(_train(d, job_id) for d in staying)), 30)
            job = await _wait_final(control, admin, job_id, 30)
            took = time.monotonic() - started
            assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
            assert done == [1, 1]
            assert took < 10
            # It called again: it is back, eligible as before.
            await leaving.get_job()
            assert (await store.get_device(leaving.device_id)).state is DeviceState.ONLINE
            assert leaving.device_id in await _eligible(store, "liveness", 3)


async def test_a_device_that_asked_for_another_job_only_is_not_sampled(tmp_path: Path) -> None:
    async with Coordinator(local_settings(tmp_path, **FAST_POLLING)) as coordinator:
        assert coordinator.endpoint is not None and coordinator.store is not None
        admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
            anything, elsewhere = [await StubDevice(channel).enroll() for _ in range(2)]
            assert (await anything.get_job()).status == rpb.RUNNER_STATUS_NO_JOB
            assert (await elsewhere.get_job("another-job")).status == rpb.RUNNER_STATUS_NO_JOB
            sha = await upload_model(control, weights_dxo({"w": np.zeros(3, np.float32)}), admin)
            job_id = (
                await control.SubmitJob(cpb.SubmitJobRequest(spec=_spec(sha)), metadata=admin)
            ).job.job_id
            assert (await anything.get_job()).job_id == job_id
            assert await asyncio.wait_for(_train(anything, job_id), 30) == 1
            job = await _wait_final(control, admin, job_id, 30)
        assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
        assert await _targets(coordinator.store, job_id) == {anything.device_id}


async def test_a_runner_whose_session_ends_signs_off(tmp_path: Path) -> None:
    # No job within its job timeout: the session ends, and the device is OFFLINE at once.
    async with Coordinator(local_settings(tmp_path, **FAST_POLLING)) as coordinator:
        assert coordinator.endpoint is not None and coordinator.store is not None
        runner = _runner(coordinator.endpoint.address, tmp_path / "runner", _npz(tmp_path, 0))
        runner.job_timeout = 0.5
        await asyncio.wait_for(runner.run_async(), 30)
        device = await coordinator.store.get_device(runner.transport.device_id)
        assert device.state is DeviceState.OFFLINE
        assert coordinator.settings.online_window > timedelta(seconds=5)  # not the window's doing


def test_online_means_a_call_within_seconds_derived_from_the_polling_cadence(tmp_path: Path) -> None:
    settings = CoordinatorSettings(data_dir=tmp_path)
    assert settings.online_window == settings.max_task_wait + settings.job_retry_after + timedelta(seconds=10)
    assert settings.online_window < timedelta(minutes=1)
    fast = CoordinatorSettings(data_dir=tmp_path, **FAST_POLLING)
    assert fast.online_window == timedelta(seconds=11.2)
    # A window a polling device could fall out of is refused, naming both settings.
    with pytest.raises(InvalidArgument, match="max_task_wait \\+ job_retry_after"):
        CoordinatorSettings(data_dir=tmp_path, device_offline_after=timedelta(seconds=30))
    given = CoordinatorSettings(data_dir=tmp_path, device_offline_after=timedelta(seconds=35))
    assert given.online_window == timedelta(seconds=35)
