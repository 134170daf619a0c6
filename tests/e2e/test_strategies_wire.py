"""Every built-in strategy over the wire API: submitted as its typed message, described as submitted,
run to the end by devices written against the generated stubs only."""

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
ROUNDS = 2
#: Each strategy with parameters other than its defaults (a description must say them back).
STRATEGIES: dict[str, dict[str, object]] = {
    "fedavg": {},
    "fedavgm": {"server_learning_rate": 0.5, "server_momentum": 0.8},
    "fedadam": {
        "server_learning_rate": 0.05,
        "beta_1": 0.8,
        "beta_2": 0.95,
        "tau": 0.01,
        "bias_correction": False,
    },
    "fedyogi": {"server_learning_rate": 0.02, "beta_1": 0.85, "beta_2": 0.9, "tau": 0.002},
    "fedadagrad": {"server_learning_rate": 0.2, "tau": 0.01},
    "fedmedian": {},
    "fedtrimmedavg": {"beta": 0.25},
    "krum": {"num_malicious": 1, "num_to_select": 2},
}


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[Coordinator]:
    async with Coordinator(local_settings(tmp_path, max_buffered_round_bytes=10_000)) as c:
        yield c


def _spec(name: str, sha: str, **rounds: int) -> cpb.JobSpec:
    spec = cpb.JobSpec(name=f"wire-{name}", initial_model=dxo_pb2.BlobRef(sha256=sha))
    message = getattr(spec, name)
    config = message if name == "fedavg" else message.rounds
    config.num_rounds = rounds.get("num_rounds", ROUNDS)
    config.devices_per_round = rounds.get("devices_per_round", DEVICES)
    config.round_timeout.FromSeconds(30)
    config.seed = 3
    for key, value in STRATEGIES[name].items():
        setattr(message, key, value)
    return spec


async def _device(device: StubDevice, index: int, versions: list[tuple[int, int, str]]) -> None:
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
        # The task says its round and the version of the model it carries, which the DXO's meta repeats
        # from the second round on (the initial model has none of its own).
        meta = task.task_data.dxo.meta
        carried = str(meta["model_version"].int_value) if "model_version" in meta else "-"
        versions.append((task.round, task.model_version, carried))
        diff = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
        for name, tensor in task.task_data.dxo.data.items():
            value = read_tensor(tensor)
            step = np.random.default_rng([index, task.round]).normal(size=value.shape) * 0.1
            diff.data[name].CopyFrom(dense(step.astype(np.float32)))
        diff.meta["num_examples"].int_value = 10 * (index + 1)
        reply = await device.report(job.job_id, task, diff)
        assert reply.status == rpb.RUNNER_STATUS_OK, reply
        cookie = reply.cookie


@pytest.mark.parametrize("name", sorted(STRATEGIES))
async def test_each_strategy_runs_over_the_wire_and_is_described_as_submitted(
    coordinator: Coordinator, name: str
) -> None:
    assert coordinator.endpoint is not None
    admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
    initial = {"w": np.full((2, 3), 0.5, np.float32), "b": np.zeros(3, np.float32)}
    async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
        control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
        devices = [await StubDevice(channel).enroll() for _ in range(DEVICES)]
        sha = await upload_model(control, weights_dxo(initial), admin)
        spec = _spec(name, sha)
        submitted = await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)
        job_id = submitted.job.job_id
        versions: list[tuple[int, int, str]] = []
        await asyncio.wait_for(asyncio.gather(*(_device(d, i, versions) for i, d in enumerate(devices))), 60)
        job = (await control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=admin)).job
        final = await download_model(control, job_id, admin)

    assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
    assert (job.current_round, job.completed_rounds) == (ROUNDS, ROUNDS)
    assert job.spec.WhichOneof("workflow") == name  # as submitted, not turned into FedAvg
    described = getattr(job.spec, name)
    for key, value in STRATEGIES[name].items():
        assert getattr(described, key) == pytest.approx(value), key
    rounds = described if name == "fedavg" else described.rounds
    assert (rounds.num_rounds, rounds.devices_per_round, rounds.seed) == (ROUNDS, DEVICES, 3)
    assert rounds.keep_checkpoints == 3  # left out: the coordinator's default, written out
    assert job.spec.initial_model.size_bytes == len(
        weights_dxo(initial).SerializeToString(deterministic=True)
    )
    assert sorted(versions) == sorted(
        (r, r - 1, "-" if r == 1 else str(r - 1)) for r in (1, 2) for _ in devices
    )
    moved = {k: read_tensor(t) for k, t in final.data.items()}
    assert any(not np.array_equal(moved[k], initial[k]) for k in initial)


async def test_a_robust_round_over_the_memory_cap_is_refused_at_submit(coordinator: Coordinator) -> None:
    assert coordinator.endpoint is not None
    admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
    model = weights_dxo({"w": np.zeros(1000, np.float32)})  # ~4 kB; the cap is 10,000 bytes
    async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
        control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
        sha = await upload_model(control, model, admin)
        for name in ("fedmedian", "fedtrimmedavg", "krum"):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await control.SubmitJob(cpb.SubmitJobRequest(spec=_spec(name, sha)), metadata=admin)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "max_buffered_round_bytes" in str(refused.value.details())
            # Without devices_per_round the bound is unknown: refused too, saying why.
            spec = _spec(name, sha, devices_per_round=0)
            with pytest.raises(grpc.aio.AioRpcError) as unbounded:
                await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)
            assert unbounded.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "devices_per_round must be set" in str(unbounded.value.details())
        small = weights_dxo({"w": np.zeros(10, np.float32)})
        sha = await upload_model(control, small, admin)
        accepted = await control.SubmitJob(cpb.SubmitJobRequest(spec=_spec("fedmedian", sha)), metadata=admin)
        assert accepted.job.spec.WhichOneof("workflow") == "fedmedian"
        listed = await control.ListJobs(cpb.ListJobsRequest(), metadata=admin)
        assert [j.spec.name for j in listed.jobs] == ["wire-fedmedian"]  # the refused ones left nothing


async def test_bad_strategy_parameters_get_invalid_argument_naming_them(coordinator: Coordinator) -> None:
    assert coordinator.endpoint is not None
    admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
    async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
        control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
        sha = await upload_model(control, weights_dxo({"w": np.zeros(3, np.float32)}), admin)
        cases = [
            ("fedadam", "beta_1", 1.0, "fedadam.beta_1 must be in [0, 1)"),
            ("fedyogi", "tau", 0.0, "fedyogi.tau must be a positive number"),
            ("fedavgm", "server_learning_rate", -1.0, "fedavgm.server_learning_rate must be a positive"),
            ("fedtrimmedavg", "beta", 0.5, "fedtrimmedavg.beta must be in [0, 0.5)"),
            ("krum", "num_to_select", 9, "krum.num_to_select must be in [1, devices_per_round]"),
            ("fedadam", "server_learning_rate", float("nan"), "server_learning_rate must be a finite number"),
        ]
        for name, key, value, message in cases:
            spec = _spec(name, sha)
            setattr(getattr(spec, name), key, value)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, key)
            assert message in str(refused.value.details()), refused.value.details()
