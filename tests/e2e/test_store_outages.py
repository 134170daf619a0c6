"""A coordinator on PostgreSQL whose database connections are terminated under it, over real gRPC.

The server itself terminates the coordinator's connections (``pg_terminate_backend``, as a restart or a
failover would): from outside at chosen moments of a job (after an acknowledgement, while devices train,
while a round closes), and from inside the coordinator's own connection at chosen statements and commits
(see :class:`~fedlink.server.store.testing.PgFaults`). A job disturbed that way several times finishes,
counts every result once, and ends with the bits of the same job run undisturbed. A database that stays
away longer than the retry budget gives devices UNAVAILABLE with a ``retry_after`` (never INTERNAL) and
health NOT_SERVING; the coordinator waits it out, and carries on once the database is back.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sklearn.datasets import load_digits

from fedlink.common.dxo import DXO, DataKind
from fedlink.common.retry_info import retry_after_of
from fedlink.runner.data import NpzDataSource
from fedlink.runner.loop import Runner
from fedlink.runner.transport.backoff import Backoff
from fedlink.runner.transport.base import Ack, ResultReport, Status, TaskOffer
from fedlink.runner.transport.grpc_transport import GrpcTransport, GrpcTransportConfig
from fedlink.server.app import Coordinator
from fedlink.server.domain import ResultStatus
from fedlink.server.store import SqlStateStore
from fedlink.server.store.testing import PgFaults
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import Metadata, StubDevice, dense, local_settings, read_tensor, upload_model, weights_dxo

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

ROUNDS = 3
DEVICES = 3
FINAL = (states_pb2.JOB_STATE_FINISHED, states_pb2.JOB_STATE_FAILED, states_pb2.JOB_STATE_ABORTED)
#: Faults that fire inside the coordinator's own connection, at these statements.
RESULTS = r"INSERT INTO results\b"
CHECKPOINTS = r"INSERT INTO checkpoints\b"
TASKS = r"INSERT INTO tasks\b"
CLAIMS = r"INSERT INTO assignments\b"


@dataclass
class Operator:
    """A coordinator on PostgreSQL, the operator's side of it, and the faults to break its store with."""

    coordinator: Coordinator
    control: cgrpc.ControlServiceAsyncStub
    channel: grpc.aio.Channel
    admin: Metadata
    faults: PgFaults
    tmp: Path

    @property
    def address(self) -> str:
        assert self.coordinator.endpoint is not None
        return self.coordinator.endpoint.address

    @property
    def store(self) -> SqlStateStore:
        assert self.coordinator.store is not None
        return self.coordinator.store

    async def submit(self, name: str, model_sha: str, job_data: dict[str, Any]) -> str:
        spec = cpb.JobSpec(
            name=name, job_data=json.dumps(job_data), initial_model=dxo_pb2.BlobRef(sha256=model_sha)
        )
        spec.fedavg.num_rounds = ROUNDS
        spec.fedavg.devices_per_round = DEVICES
        spec.fedavg.min_results = DEVICES
        spec.fedavg.seed = 5
        spec.fedavg.round_timeout.FromSeconds(600)  # rounds close on their results; a bound, not a wait
        request = cpb.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4()))
        return str((await self.control.SubmitJob(request, metadata=self.admin)).job.job_id)

    async def wait_final(self, job_id: str, within: float = 120) -> cpb.Job:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            reply = await self.control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=self.admin)
            if reply.job.state in FINAL:
                return reply.job
            assert loop.time() < deadline, f"job {job_id} is still {reply.job.state} after {within:g}s"
            await asyncio.sleep(0.05)

    async def model(self, job_id: str, round: int = 0) -> dict[str, np.ndarray]:
        request = cpb.DownloadModelRequest(job_id=job_id, round=round)
        data = b"".join([c.data async for c in self.control.DownloadModel(request, metadata=self.admin)])
        return dict(DXO.from_bytes(data).data)


@pytest.fixture
async def operator(tmp_path: Path, pg_database: str) -> AsyncIterator[Operator]:
    settings = local_settings(
        tmp_path,
        db_url=pg_database,
        auto_migrate=True,
        store_retry_budget=timedelta(seconds=1),
        loop_failure_timeout=timedelta(seconds=2),
        reaper_interval=timedelta(milliseconds=200),
        shutdown_grace=timedelta(seconds=1),
    )
    async with Coordinator(settings) as coordinator:
        assert coordinator.endpoint is not None and coordinator.store is not None
        async with (
            grpc.aio.insecure_channel(coordinator.endpoint.address) as channel,
            PgFaults(coordinator.store.database, pg_database) as faults,
        ):
            yield Operator(
                coordinator=coordinator,
                control=cgrpc.ControlServiceStub(channel),
                channel=channel,
                admin=(("authorization", f"Bearer {coordinator.admin_token}"),),
                faults=faults,
                tmp=tmp_path,
            )


# ---- a disturbed job against an undisturbed one ----


def digits_partitions(directory: Path) -> list[Path]:
    """The digits split IID into DEVICES .npz files (train and valid)."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(y))
    paths = []
    for i, part in enumerate(np.array_split(order, DEVICES)):
        cut = int(len(part) * 0.8)
        path = directory / f"part{i}.npz"
        np.savez(
            path, x_train=x[part[:cut]], y_train=y[part[:cut]], x_valid=x[part[cut:]], y_valid=y[part[cut:]]
        )
        paths.append(path)
    return paths


SOFTMAX = {
    "components": [
        {
            "type": "SoftmaxRegressionTrainer",
            "name": "trainer",
            "args": {"epochs": 2, "batch_size": 16, "learning_rate": 0.5},
        }
    ],
    "executors": {"*": "@trainer"},
}


@dataclass
class Chaos:
    """When to break the store during the disturbed job: hooks the runners' transports call as the job
    goes (each runs before the runner sees the reply, so its effect is ordered with the runner's next
    call). ``enabled`` is off for the undisturbed job."""

    faults: PgFaults
    enabled: bool = False
    started: Counter[int] = field(default_factory=Counter)
    acked: Counter[int] = field(default_factory=Counter)
    background: set[asyncio.Task[None]] = field(default_factory=set)

    def enable(self) -> None:
        """Breaks the store from now on (counting the job's rounds from the start)."""
        self.enabled = True
        self.started.clear()
        self.acked.clear()

    async def task_started(self, round_no: int) -> None:
        self.started[round_no] += 1
        if not self.enabled or self.started[round_no] != 1:
            return
        if round_no == 1:
            self.faults.kill_before(RESULTS)  # the round's first report batch, cut before its commit
            self.faults.kill_before(CHECKPOINTS)  # the round's close, cut before its commit
        elif round_no == 2:
            self.faults.lose_commit(CHECKPOINTS, committed=True)  # the round's close, answer lost
            self._soon(0.03)  # while the devices train
        elif round_no == 3:
            self.faults.lose_commit(RESULTS, committed=True)  # a report's commit, answer lost
            self.faults.lose_commit(CHECKPOINTS, committed=False)  # the round's close, commit cut
            self._soon(0.03)

    async def acknowledged(self, round_no: int) -> None:
        self.acked[round_no] += 1
        if not self.enabled:
            return
        first, last = self.acked[round_no] == 1, self.acked[round_no] == DEVICES
        if round_no == 1 and first:
            await self.faults.terminate()  # right after an acknowledgement
            self.faults.kill_before(CLAIMS)  # the next claim (round 2's), cut before its commit
        if round_no == 2 and first:
            self.faults.lose_commit(TASKS, committed=True)  # round 3's tasks, their commit's answer lost
        if last and round_no in (1, 2):
            await self.faults.terminate()  # the round closes now
        if round_no == 3:
            await self.faults.terminate()  # after every acknowledgement

    def _soon(self, delay: float) -> None:
        async def later() -> None:
            await asyncio.sleep(delay)
            await self.faults.terminate()

        task = asyncio.get_running_loop().create_task(later())
        self.background.add(task)
        task.add_done_callback(self.background.discard)


class ChaosTransport(GrpcTransport):
    """The runner's real gRPC transport, telling :class:`Chaos` when a task starts and when a report
    was acknowledged (the RPCs themselves are the transport's own)."""

    def __init__(self, config: GrpcTransportConfig, chaos: Chaos) -> None:
        super().__init__(config)
        self._chaos = chaos
        self._round = 0

    async def get_task(self, *, job_id: str, cookie: bytes) -> TaskOffer:
        offer = await super().get_task(job_id=job_id, cookie=cookie)
        if offer.status is Status.OK:
            self._round = offer.round
            await self._chaos.task_started(offer.round)
        return offer

    async def report_result(self, report: ResultReport) -> Ack:
        ack = await super().report_result(report)
        if ack.status is Status.OK:
            await self._chaos.acknowledged(self._round)
        return ack


async def run_job(
    op: Operator, chaos: Chaos, name: str, model_sha: str, parts: list[Path]
) -> tuple[str, list[Runner], list[ChaosTransport]]:
    """Submits a job named ``name`` and runs it to its end with one real runner per partition (the same
    state directories, so the same devices, every time)."""
    job_id = await op.submit(name, model_sha, SOFTMAX)
    transports = [
        ChaosTransport(
            GrpcTransportConfig(
                server=op.address,
                state_dir=op.tmp / f"device{i}",
                insecure=True,
                task_wait=timedelta(seconds=2),
                per_request=timedelta(seconds=20),
                backoff=Backoff(base=timedelta(milliseconds=50), cap=timedelta(milliseconds=500)),
            ),
            chaos,
        )
        for i in range(len(parts))
    ]
    runners = [
        Runner(name, NpzDataSource(part), {"platform": "test"}, {}, 30.0, transport=transport)
        for part, transport in zip(parts, transports, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(r.run_async() for r in runners)), timeout=240)
    return job_id, runners, transports


async def test_a_job_whose_store_connections_are_terminated_again_and_again_ends_with_the_same_model(
    operator: Operator,
) -> None:
    op = operator
    parts = digits_partitions(op.tmp)
    initial = DXO(
        kind=DataKind.WEIGHTS,
        data={"weight": np.zeros((64, 10), np.float32), "bias": np.zeros((10,), np.float32)},
    ).to_bytes()
    sha = hashlib.sha256(initial).hexdigest()
    await op.store.blobs.put_bytes(initial)
    chaos = Chaos(op.faults)

    calm_id, calm_runners, _ = await run_job(op, chaos, "undisturbed", sha, parts)
    assert (await op.wait_final(calm_id)).state == states_pb2.JOB_STATE_FINISHED
    assert op.faults.fired == {}

    chaos.enable()
    job_id, runners, transports = await run_job(op, chaos, "disturbed", sha, parts)
    job = await op.wait_final(job_id)
    assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
    await asyncio.gather(*chaos.background)

    # Every planned fault hit: the store's connections broke before commits, during commits, while
    # idle and in flight.
    fired = op.faults.fired
    assert op.faults.armed() == 0, "a planned fault never came to its statement"
    assert fired["killed"] == 3 and fired["commit lost"] == 3 and fired["commit cut"] == 1, fired
    assert fired["terminated"] >= 8, fired

    # No device saw them: every report acknowledged OK, no call failed at all (INTERNAL least of all):
    # the store retried on fresh connections within its budget.
    for runner in runners:
        assert [(r.outcome, r.ack) for r in runner.history] == [("SUCCEEDED", "OK")] * ROUNDS
    for transport in transports:
        assert transport.failed_attempts == []

    # Every result counted once: one task per device per round, one assignment per task, one accepted
    # result per task, each round closed once.
    run = await op.store.get_current_run(job_id)
    tasks = await op.store.list_tasks(run.run_id)
    assert sorted(Counter(t.round for t in tasks).items()) == [(r, DEVICES) for r in range(1, ROUNDS + 1)]
    assignments = await op.store.list_assignments(task_ids=[t.task_id for t in tasks])
    assert sorted(a.task_id for a in assignments) == sorted(t.task_id for t in tasks)
    results = await op.store.list_results(run_id=run.run_id, accepted_only=False)
    assert sorted(r.task_id for r in results) == sorted(t.task_id for t in tasks)
    assert all(r.accepted and not r.stale and r.status is ResultStatus.SUCCEEDED for r in results)
    for round_no in range(1, ROUNDS + 1):
        in_round = {t.task_id for t in tasks if t.round == round_no}
        devices = sorted(r.device_id for r in results if r.task_id in in_round)
        assert devices == sorted(t.device_id for t in transports)
    events = await op.store.list_job_events(job_id)
    assert Counter(e.kind for e in events)["round_closed"] == ROUNDS

    # The same bits as the undisturbed job, round by round and at the end.
    for round_no in (*range(1, ROUNDS + 1), 0):
        calm, disturbed = await op.model(calm_id, round_no), await op.model(job_id, round_no)
        assert calm.keys() == disturbed.keys()
        for key in calm:
            assert calm[key].tobytes() == disturbed[key].tobytes(), f"{key} differs after round {round_no}"
    assert np.abs((await op.model(job_id))["weight"]).sum() > 0  # the devices' updates reached it
    assert [r.outcome for r in calm_runners[0].history] == ["SUCCEEDED"] * ROUNDS


# ---- an outage longer than the retry budget ----

MODEL = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}


def _update(device: StubDevice, examples: int) -> dxo_pb2.Dxo:
    rng = np.random.default_rng(list(device.device_id.encode()))
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    dxo.data["w"].CopyFrom(dense(rng.normal(size=(2, 3)).astype(np.float32)))
    dxo.meta["num_examples"].int_value = examples
    return dxo


def _report(
    job_id: str, task: rpb.GetTaskResponse, dxo: dxo_pb2.Dxo, request_id: str
) -> rpb.ReportResultRequest:
    request = rpb.ReportResultRequest(
        job_id=job_id,
        task_id=task.task_id,
        cookie=task.cookie,
        status=states_pb2.RESULT_STATUS_SUCCEEDED,
        request_id=request_id,
    )
    request.result.dxo.CopyFrom(dxo)
    return request


async def _health(channel: grpc.aio.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int((await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)).status)


async def _until_health(channel: grpc.aio.Channel, status: int, within: float = 15) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while await _health(channel) != status:
        assert loop.time() < deadline, (
            f"health did not turn {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
        )
        await asyncio.sleep(0.05)


def _unavailable(error: grpc.aio.AioRpcError, what: str) -> timedelta:
    """Checks a refused call was UNAVAILABLE with a retry_after (never INTERNAL); returns the wait."""
    assert error.code() is grpc.StatusCode.UNAVAILABLE, f"{what}: {error.code().name}: {error.details()}"
    retry_after = retry_after_of(error.trailing_metadata())
    assert retry_after is not None and retry_after > timedelta(0), f"{what} said no retry_after"
    return retry_after


async def test_a_store_away_longer_than_the_budget_is_unavailable_with_retry_after_then_recovers(
    operator: Operator,
) -> None:
    op = operator
    devices = [await StubDevice(op.channel).enroll() for _ in range(2)]
    sha = await upload_model(op.control, weights_dxo(MODEL), op.admin)
    spec = cpb.JobSpec(name="outage", initial_model=dxo_pb2.BlobRef(sha256=sha))
    spec.fedavg.CopyFrom(cpb.FedAvgConfig(num_rounds=1, devices_per_round=2, min_results=2, seed=1))
    spec.fedavg.round_timeout.FromSeconds(600)
    submitted = await op.control.SubmitJob(
        cpb.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4())), metadata=op.admin
    )
    job_id = submitted.job.job_id
    tasks: dict[str, rpb.GetTaskResponse] = {}
    for _ in range(100):  # the devices poll side by side, as devices do, until each holds its task
        for device in devices:
            if device.device_id not in tasks and (await device.get_job()).status == rpb.RUNNER_STATUS_OK:
                task = await device.get_task(job_id, wait_s=0.2)
                if task.status == rpb.RUNNER_STATUS_OK:
                    tasks[device.device_id] = task
        if len(tasks) == len(devices):
            break
    assert len(tasks) == 2, "both devices should hold a task before the outage"
    updates = {d.device_id: _update(d, examples) for d, examples in zip(devices, (30, 70), strict=True)}
    request_ids = {d.device_id: str(uuid.uuid4()) for d in devices}
    assert await _health(op.channel) == health_pb2.HealthCheckResponse.SERVING

    await op.faults.refuse()
    first, second = devices
    report = _report(job_id, tasks[first.device_id], updates[first.device_id], request_ids[first.device_id])
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await first.stub.ReportResult(report, metadata=first.metadata, timeout=30)
    assert _unavailable(refused.value, "ReportResult") == op.store.database.retry.retry_after
    await _until_health(op.channel, health_pb2.HealthCheckResponse.NOT_SERVING)
    for what, call in (
        ("GetTask", second.get_task(job_id, tasks[second.device_id].cookie, wait_s=2)),
        ("GetJob", second.get_job()),
        ("ReportResult again", first.stub.ReportResult(report, metadata=first.metadata, timeout=30)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        _unavailable(refused.value, what)
    # Longer than loop_failure_timeout: the background loops wait it out, the coordinator goes on.
    await asyncio.sleep(3)
    assert await _health(op.channel) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert op.coordinator.failure is None and op.coordinator.core is not None
    assert op.coordinator.core.failure is None

    await op.faults.allow()
    await _until_health(op.channel, health_pb2.HealthCheckResponse.SERVING)
    # The devices retry their reports with the same request ids: both count, once.
    for device in devices:
        again = _report(
            job_id, tasks[device.device_id], updates[device.device_id], request_ids[device.device_id]
        )
        reply = await device.stub.ReportResult(again, metadata=device.metadata, timeout=30)
        assert reply.status == rpb.RUNNER_STATUS_OK, reply
    job = await op.wait_final(job_id)
    assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
    run = await op.store.get_current_run(job_id)
    results = await op.store.list_results(run_id=run.run_id, accepted_only=False)
    assert sorted(r.device_id for r in results) == sorted(tasks) and all(r.accepted for r in results)

    total, weight = np.zeros((2, 3), np.float64), 0.0
    for device_id in sorted(updates):
        examples = float(updates[device_id].meta["num_examples"].int_value)
        total += read_tensor(updates[device_id].data["w"]).astype(np.float64) * examples
        weight += examples
    expected = (MODEL["w"].astype(np.float64) + total / weight).astype(np.float32)
    assert np.array_equal((await op.model(job_id))["w"], expected)
