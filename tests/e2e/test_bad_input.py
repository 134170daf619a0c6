"""Bad input over real gRPC: each gets its precise status and a message a person can act on (never
UNKNOWN or INTERNAL), changes nothing it should not, and leaves the good devices' aggregate exact."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from fedlink.server.app import Coordinator
from fedlink.server.domain import AssignmentState
from fedlink.server.store import SqlStateStore
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, runner_service_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import (
    Metadata,
    StubDevice,
    dense,
    download_model,
    local_settings,
    read_tensor,
    upload_model,
    weights_dxo,
)

RUNNER = runner_service_pb2.DESCRIPTOR.services_by_name["RunnerService"]
CONTROL = cpb.DESCRIPTOR.services_by_name["ControlService"]
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
DENIED = grpc.StatusCode.PERMISSION_DENIED
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
MODEL = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}
MAX_MESSAGE_BYTES = 256 * 1024
#: How long to wait for something the coordinator does on its own (a state, a task): far beyond the
#: milliseconds it takes (or the round deadline it waits out), so that a loaded machine is no failure,
#: and a hang still is one.
WAIT_S = 120.0
#: Round deadlines and leases that a test waits out, tried in turn: the first keeps a quiet run short;
#: when a loaded machine lets one run out before the good devices have even reported, that attempt
#: proves nothing and the next, longer one is made.
ROUND_DEADLINES_S = (4, 16, 64)
LEASES_S = (2, 8, 32)


async def expect(call: Awaitable[Any], code: grpc.StatusCode, *fragments: str) -> str:
    """Awaits a call that must fail with ``code`` and a message holding each fragment; returns it."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        details = error.details() or ""
        assert error.code() is code, f"got {error.code().name} ({details!r}), expected {code.name}"
        for fragment in fragments:
            assert fragment.lower() in details.lower(), f"{fragment!r} not in {details!r}"
        return details
    raise AssertionError(f"the call succeeded; expected {code.name}")


@dataclass(slots=True, kw_only=True)
class Held:
    """A device with the task it holds."""

    device: StubDevice
    task: rpb.GetTaskResponse


@dataclass(slots=True, kw_only=True)
class Round:
    """An open round of a one-job coordinator: A and B are good devices, M sends bad input."""

    coordinator: Coordinator
    channel: grpc.aio.Channel
    control: cgrpc.ControlServiceAsyncStub
    admin: Metadata
    job_id: str
    a: Held
    b: Held
    m: Held

    @property
    def store(self) -> SqlStateStore:
        assert self.coordinator.store is not None
        return self.coordinator.store

    async def job(self) -> cpb.Job:
        return (
            await self.control.DescribeJob(cpb.DescribeJobRequest(job_id=self.job_id), metadata=self.admin)
        ).job

    async def wait_for_state(self, state: int) -> cpb.Job:
        """Polls the job until it is in ``state`` (bounded: a hang fails the test)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while loop.time() < deadline:
            job = await self.job()
            if job.state == state:
                return job
            await asyncio.sleep(0.05)
        raise AssertionError(f"job {self.job_id} is {states_pb2.JobState.Name(job.state)}: {job.message}")


async def take_task(device: StubDevice, job_id: str, cookie: bytes = b"") -> Held:
    """Polls until the device gets a task of the job."""
    async with asyncio.timeout(WAIT_S):
        while True:
            task = await device.get_task(job_id, cookie, wait_s=0.5)
            if task.status == rpb.RUNNER_STATUS_OK:
                return Held(device=device, task=task)


@asynccontextmanager
async def open_round(
    tmp_path: Path, *, num_rounds: int = 1, round_timeout_s: int = 60, **settings: Any
) -> AsyncIterator[Round]:
    """A coordinator whose job sampled A, B and M; needs 2 results to close a round."""
    config = local_settings(
        tmp_path,
        max_message_bytes=MAX_MESSAGE_BYTES,
        inline_payload_bytes=MAX_MESSAGE_BYTES // 4,
        **settings,
    )
    async with Coordinator(config) as coordinator:
        assert coordinator.endpoint is not None
        admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
            devices = [await StubDevice(channel).enroll() for _ in range(3)]
            for device in devices:  # runners ask for work first: only devices that asked are sampled
                await device.get_job()
            sha = await upload_model(control, weights_dxo(MODEL), admin)
            spec = cpb.JobSpec(name="bad-input", initial_model=dxo_pb2.BlobRef(sha256=sha))
            spec.fedavg.num_rounds = num_rounds
            spec.fedavg.min_devices = 3
            spec.fedavg.min_results = 2
            spec.fedavg.round_timeout.FromSeconds(round_timeout_s)
            job = (await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)).job
            a, b, m = [await take_task(d, job.job_id) for d in devices]
            yield Round(
                coordinator=coordinator,
                channel=channel,
                control=control,
                admin=admin,
                job_id=job.job_id,
                a=a,
                b=b,
                m=m,
            )


def update(seed: int, num_examples: int = 10) -> dxo_pb2.Dxo:
    """A distinct, valid WEIGHT_DIFF for MODEL."""
    rng = np.random.default_rng(seed)
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    for name, value in MODEL.items():
        dxo.data[name].CopyFrom(dense(rng.normal(size=value.shape).astype(np.float32)))
    dxo.meta["num_examples"].int_value = num_examples
    return dxo


def fedavg(updates: list[tuple[str, dxo_pb2.Dxo]]) -> dict[str, np.ndarray]:
    """MODEL plus the weighted mean of ``(device_id, update)`` in the coordinator's canonical order."""
    out: dict[str, np.ndarray] = {}
    for name, value in MODEL.items():
        total = np.zeros(value.shape, np.float64)
        weight = 0.0
        for _, dxo in sorted(updates, key=lambda u: u[0]):
            w = float(dxo.meta["num_examples"].int_value)
            total += read_tensor(dxo.data[name]).astype(np.float64) * np.float64(w)
            weight += w
        out[name] = (value.astype(np.float64) + total / weight).astype(np.float32)
    return out


def report(
    job_id: str,
    held: Held,
    dxo: dxo_pb2.Dxo | None,
    *,
    status: int = states_pb2.RESULT_STATUS_SUCCEEDED,
    request_id: str | None = None,
    cookie: bytes | None = None,
    task_id: str | None = None,
) -> rpb.ReportResultRequest:
    """A ReportResult request for the task ``held`` holds, with what to vary."""
    request = rpb.ReportResultRequest(
        job_id=job_id,
        task_id=held.task.task_id if task_id is None else task_id,
        cookie=held.task.cookie if cookie is None else cookie,
        status=status,  # type: ignore[arg-type]
        request_id=request_id or str(uuid.uuid4()),
    )
    if dxo is not None:
        request.result.dxo.CopyFrom(dxo)
    return request


async def send(held: Held, request: rpb.ReportResultRequest) -> rpb.ReportResultResponse:
    return await held.device.stub.ReportResult(request, metadata=held.device.metadata)


async def finish_with_good_results(r: Round) -> None:
    """A and B report distinct updates, M reports a failure; the final model is A's and B's average."""
    good = [(r.a.device.device_id, update(1, 30)), (r.b.device.device_id, update(2, 70))]
    for held, (_, dxo) in zip((r.a, r.b), good, strict=True):
        assert (await send(held, report(r.job_id, held, dxo))).status == rpb.RUNNER_STATUS_OK
    failed = report(r.job_id, r.m, None, status=states_pb2.RESULT_STATUS_FAILED)
    failed.error_message = "executor raised"
    assert (await send(r.m, failed)).status == rpb.RUNNER_STATUS_OK
    job = await r.wait_for_state(states_pb2.JOB_STATE_FINISHED)
    assert job.current_round == 1
    final = await download_model(r.control, r.job_id, r.admin)
    for name, value in fedavg(good).items():
        assert read_tensor(final.data[name]).tobytes() == value.tobytes(), name


def _tensor(array: np.ndarray) -> dxo_pb2.Tensor:
    return dense(array)


def _with(name: str, tensor: dxo_pb2.Tensor, *, drop_weight: bool = False) -> dxo_pb2.Dxo:
    dxo = update(9)
    dxo.data[name].CopyFrom(tensor)
    if drop_weight:
        del dxo.meta["num_examples"]
    return dxo


def _meta(value: dxo_pb2.MetaValue | None) -> dxo_pb2.Dxo:
    dxo = update(9)
    del dxo.meta["num_examples"]
    if value is not None:
        dxo.meta["num_examples"].CopyFrom(value)
    return dxo


def _kind(kind: int) -> dxo_pb2.Dxo:
    dxo = update(9)
    dxo.kind = kind  # type: ignore[assignment]
    return dxo


def _no_data() -> dxo_pb2.Dxo:
    dxo = update(9)
    dxo.ClearField("data")
    return dxo


NAN = np.full((2, 3), np.nan, np.float32)
INF = np.array([[0, np.inf, 0], [0, 0, 0]], np.float32)
# Each bad result M sends: what it is, the result, the status it must get, words its message must hold.
BAD_RESULTS: list[tuple[str, dxo_pb2.Dxo, grpc.StatusCode, tuple[str, ...]]] = [
    ("wrong shape", _with("w", _tensor(np.zeros((3, 2), np.float32))), INVALID, ("'w'", "shape")),
    ("wrong dtype", _with("w", _tensor(np.zeros((2, 3), np.float64))), INVALID, ("'w'", "dtype")),
    ("NaN", _with("w", _tensor(NAN)), INVALID, ("'w'", "NaN")),
    ("Inf", _with("w", _tensor(INF)), INVALID, ("'w'", "Inf")),
    (
        "NaN in float16",
        _with(
            "w",
            dxo_pb2.Tensor(
                dtype="float32",
                shape=[2, 3],
                float16=dxo_pb2.Float16Encoding(data=NAN.astype("<f2").tobytes()),
            ),
        ),
        INVALID,
        ("'w'", "NaN"),
    ),
    (
        "sparse index out of range",
        _with(
            "w",
            dxo_pb2.Tensor(
                dtype="float32",
                shape=[2, 3],
                sparse=dxo_pb2.SparseEncoding(
                    indices=np.array([6], "<i8").tobytes(), values=np.ones(1, "<f4").tobytes()
                ),
            ),
        ),
        INVALID,
        ("'w'", "out of range"),
    ),
    (
        "dense bytes do not fit the shape",
        _with(
            "w", dxo_pb2.Tensor(dtype="float32", shape=[2, 3], dense=dxo_pb2.DenseEncoding(data=b"\0" * 20))
        ),
        INVALID,
        ("'w'", "20 bytes"),
    ),
    (
        "unknown variable",
        _with("z", _tensor(np.zeros(3, np.float32))),
        INVALID,
        ("'z'", "not part of the model"),
    ),
    ("no num_examples", _meta(None), INVALID, ("num_examples",)),
    ("zero num_examples", _meta(dxo_pb2.MetaValue(int_value=0)), INVALID, ("num_examples", "> 0")),
    ("negative num_examples", _meta(dxo_pb2.MetaValue(int_value=-5)), INVALID, ("num_examples", "> 0")),
    ("text num_examples", _meta(dxo_pb2.MetaValue(string_value="10")), INVALID, ("num_examples",)),
    ("NaN num_examples", _meta(dxo_pb2.MetaValue(double_value=float("nan"))), INVALID, ("num_examples",)),
    ("no variables", _no_data(), INVALID, ("no variables",)),
    ("METRICS for a train task", _kind(dxo_pb2.DATA_KIND_METRICS), INVALID, ("WEIGHTS or WEIGHT_DIFF",)),
    ("kind not set", _kind(dxo_pb2.DATA_KIND_UNSPECIFIED), INVALID, ("kind",)),
    (
        "larger than the message limit",
        _with("big", _tensor(np.zeros(MAX_MESSAGE_BYTES // 4 + 1, np.float32))),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        ("larger than max",),
    ),
]


async def test_bad_results_are_refused_and_the_good_aggregate_is_exact(tmp_path: Path) -> None:
    async with open_round(tmp_path) as r:
        failures: list[str] = []
        for label, dxo, code, fragments in BAD_RESULTS:
            try:
                await expect(send(r.m, report(r.job_id, r.m, dxo)), code, *fragments)
            except AssertionError as error:
                failures.append(f"{label}: {error}")
        # Reports that are malformed as requests rather than as results.
        no_result = report(r.job_id, r.m, None)
        unspecified = report(r.job_id, r.m, update(9), status=states_pb2.RESULT_STATUS_UNSPECIFIED)
        missing_blob = report(r.job_id, r.m, None)
        missing_blob.result.blob.sha256 = hashlib.sha256(b"never uploaded").hexdigest()
        for label, request, code, fragments in (
            ("SUCCEEDED without a result", no_result, INVALID, ("needs a result",)),
            ("status not set", unspecified, INVALID, ("status",)),
            # As for another device's blob: whether a blob exists is nothing a device may probe.
            ("result blob never uploaded", missing_blob, DENIED, ("not uploaded",)),
        ):
            try:
                await expect(send(r.m, request), code, *fragments)
            except AssertionError as error:
                failures.append(f"{label}: {error}")
        assert not failures, "\n".join(failures)
        # None of it was stored, and M still holds its task.
        run = await r.store.get_current_run(r.job_id)
        assert not await r.store.list_results(run_id=run.run_id, accepted_only=False)
        assert (await r.store.get_assignment(r.m.task.assignment_id)).state is AssignmentState.LEASED
        await finish_with_good_results(r)


def _garbage_requests(method_client_streaming: bool) -> Any:
    garbage = b"\xff\xff\xff\xff\xff"  # an unterminated varint tag: no message parses from it
    return iter([garbage, garbage]) if method_client_streaming else garbage


async def test_bytes_that_are_not_protobuf_get_invalid_argument_on_every_rpc(tmp_path: Path) -> None:
    async with open_round(tmp_path) as r:
        failures: list[str] = []
        for service, metadata in ((RUNNER, r.a.device.metadata), (CONTROL, r.admin)):
            for method in service.methods:
                path = f"/{service.full_name}/{method.name}"
                request = _garbage_requests(method.client_streaming)
                try:
                    if method.client_streaming:
                        await r.channel.stream_unary(path)(request, metadata=metadata, timeout=5)
                    elif method.server_streaming:
                        async for _ in r.channel.unary_stream(path)(request, metadata=metadata, timeout=5):
                            pass
                    else:
                        await r.channel.unary_unary(path)(request, metadata=metadata, timeout=5)
                    failures.append(f"{service.name}.{method.name}: accepted garbage")
                except grpc.aio.AioRpcError as error:
                    if error.code() is not INVALID or "protobuf" not in (error.details() or ""):
                        failures.append(
                            f"{service.name}.{method.name}: {error.code().name} {error.details()!r}"
                        )
        assert not failures, "\n".join(failures)
        await finish_with_good_results(r)  # the coordinator is unharmed


async def test_unknown_ids_are_not_found(tmp_path: Path) -> None:
    async with open_round(tmp_path) as r:
        nope = "job-that-does-not-exist"
        stub, md = r.a.device.stub, r.a.device.metadata
        await expect(stub.GetTask(rpb.GetTaskRequest(job_id=nope), metadata=md), NOT_FOUND, nope)
        await expect(send(r.a, report(r.job_id, r.a, update(1), task_id="task-nope")), NOT_FOUND, "task-nope")
        await expect(send(r.a, report(nope, r.a, update(1))), NOT_FOUND, nope)
        renew = rpb.RenewLeaseRequest(job_id=r.job_id, task_id="task-nope", cookie=r.a.task.cookie)
        await expect(stub.RenewLease(renew, metadata=md), NOT_FOUND, "task-nope")
        control, admin = r.control, r.admin
        await expect(
            control.DescribeJob(cpb.DescribeJobRequest(job_id=nope), metadata=admin), NOT_FOUND, nope
        )
        await expect(control.AbortJob(cpb.AbortJobRequest(job_id=nope), metadata=admin), NOT_FOUND, nope)
        await expect(control.DeleteJob(cpb.DeleteJobRequest(job_id=nope), metadata=admin), NOT_FOUND, nope)
        watch = control.WatchJob(cpb.WatchJobRequest(job_id=nope), metadata=admin)
        await expect(_drain(watch), NOT_FOUND, nope)
        download = control.DownloadModel(cpb.DownloadModelRequest(job_id=nope), metadata=admin)
        await expect(_drain(download), NOT_FOUND, nope)
        revoke = cpb.RevokeDeviceRequest(device_id="dev-nope")
        await expect(control.RevokeDevice(revoke, metadata=admin), NOT_FOUND, "dev-nope")
        kept = control.DownloadModel(cpb.DownloadModelRequest(job_id=r.job_id, round=7), metadata=admin)
        await expect(_drain(kept), NOT_FOUND, "round 7")
        negative = control.DownloadModel(cpb.DownloadModelRequest(job_id=r.job_id, round=-1), metadata=admin)
        await expect(_drain(negative), INVALID, "round")
        await finish_with_good_results(r)


async def _drain(stream: AsyncIterable[Any]) -> None:
    async for _ in stream:
        pass


async def test_wrong_cookies(tmp_path: Path) -> None:
    async with open_round(tmp_path) as r:
        cookie = bytearray(r.m.task.cookie)
        cookie[len(cookie) // 2] ^= 0x01
        forged = bytes(cookie)
        stub, md = r.m.device.stub, r.m.device.metadata
        await expect(send(r.m, report(r.job_id, r.m, update(3), cookie=forged)), INVALID, "cookie")
        await expect(send(r.m, report(r.job_id, r.m, update(3), cookie=b"short")), INVALID, "cookie")
        await expect(send(r.m, report(r.job_id, r.m, update(3), cookie=b"")), INVALID, "cookie")
        await expect(
            stub.GetTask(rpb.GetTaskRequest(job_id=r.job_id, cookie=forged), metadata=md), INVALID, "cookie"
        )
        lease = {"job_id": r.job_id, "task_id": r.m.task.task_id, "cookie": forged}
        await expect(stub.RenewLease(rpb.RenewLeaseRequest(**lease), metadata=md), INVALID, "cookie")  # type: ignore[arg-type]
        release = rpb.ReleaseAssignmentRequest(**lease)  # type: ignore[arg-type]
        await expect(stub.ReleaseAssignment(release, metadata=md), INVALID, "cookie")
        # A genuine cookie of another device.
        theirs = report(r.job_id, r.a, update(3))
        await expect(send(r.m, theirs), grpc.StatusCode.PERMISSION_DENIED, "another device")
        # A genuine cookie of M's that hands out no task (the one a report returns) is no task cookie.
        ok = await send(r.b, report(r.job_id, r.b, update(4)))
        await expect(send(r.b, report(r.job_id, r.b, update(4), cookie=ok.cookie)), INVALID, "cookie")
        run = await r.store.get_current_run(r.job_id)
        assert [x.device_id for x in await r.store.list_results(run_id=run.run_id, accepted_only=False)] == [
            r.b.device.device_id
        ]
        # B's report is in; A and M finish the round, and B's result counts once.
        good = [(r.a.device.device_id, update(1, 30)), (r.b.device.device_id, update(4))]
        assert (await send(r.a, report(r.job_id, r.a, good[0][1]))).status == rpb.RUNNER_STATUS_OK
        failed = report(r.job_id, r.m, None, status=states_pb2.RESULT_STATUS_FAILED)
        assert (await send(r.m, failed)).status == rpb.RUNNER_STATUS_OK
        await r.wait_for_state(states_pb2.JOB_STATE_FINISHED)
        final = await download_model(r.control, r.job_id, r.admin)
        for name, value in fedavg(good).items():
            assert read_tensor(final.data[name]).tobytes() == value.tobytes(), name


async def test_a_retry_is_answered_once_and_a_different_second_report_conflicts(tmp_path: Path) -> None:
    async with open_round(tmp_path) as r:
        first = report(r.job_id, r.a, update(1, 30))
        assert (await send(r.a, first)).status == rpb.RUNNER_STATUS_OK
        assert (await send(r.a, first)).status == rpb.RUNNER_STATUS_OK  # the same request again
        same_content = report(r.job_id, r.a, update(1, 30))  # a new request_id, the same result
        assert (await send(r.a, same_content)).status == rpb.RUNNER_STATUS_OK
        other = report(r.job_id, r.a, update(5, 30))
        await expect(send(r.a, other), PRECONDITION, "different result")
        failed = report(r.job_id, r.a, None, status=states_pb2.RESULT_STATUS_FAILED)
        await expect(send(r.a, failed), PRECONDITION, "different result")
        run = await r.store.get_current_run(r.job_id)
        stored = await r.store.list_results(run_id=run.run_id, accepted_only=False)
        assert [(x.device_id, x.request_id) for x in stored] == [(r.a.device.device_id, first.request_id)]
        good = [(r.a.device.device_id, update(1, 30)), (r.b.device.device_id, update(2, 70))]
        assert (await send(r.b, report(r.job_id, r.b, good[1][1]))).status == rpb.RUNNER_STATUS_OK
        m_failed = report(r.job_id, r.m, None, status=states_pb2.RESULT_STATUS_FAILED)
        assert (await send(r.m, m_failed)).status == rpb.RUNNER_STATUS_OK
        await r.wait_for_state(states_pb2.JOB_STATE_FINISHED)
        assert (await send(r.a, first)).status == rpb.RUNNER_STATUS_OK  # still the original answer
        final = await download_model(r.control, r.job_id, r.admin)
        for name, value in fedavg(good).items():
            assert read_tensor(final.data[name]).tobytes() == value.tobytes(), name


async def test_a_finished_jobs_task_is_done(tmp_path: Path) -> None:
    for attempt, round_timeout_s in enumerate(ROUND_DEADLINES_S):
        async with open_round(tmp_path / f"attempt-{attempt}", round_timeout_s=round_timeout_s) as r:
            good = [(r.a.device.device_id, update(1, 30)), (r.b.device.device_id, update(2, 70))]
            replies = [await send(r.a, report(r.job_id, r.a, good[0][1]))]
            replies.append(await send(r.b, report(r.job_id, r.b, good[1][1])))
            statuses = [reply.status for reply in replies]
            if statuses != [rpb.RUNNER_STATUS_OK] * 2 and round_timeout_s != ROUND_DEADLINES_S[-1]:
                continue  # the round's deadline came before A's and B's reports: once more, longer
            assert statuses == [rpb.RUNNER_STATUS_OK] * 2, replies
            await _check_a_finished_jobs_task_is_done(r, good)
            return


async def _check_a_finished_jobs_task_is_done(r: Round, good: list[tuple[str, dxo_pb2.Dxo]]) -> None:
    await r.wait_for_state(states_pb2.JOB_STATE_FINISHED)  # M never answered: the deadline closed it
    late = await send(r.m, report(r.job_id, r.m, update(3)))
    assert late.status == rpb.RUNNER_STATUS_DONE, late
    stub, md = r.m.device.stub, r.m.device.metadata
    renew = rpb.RenewLeaseRequest(job_id=r.job_id, task_id=r.m.task.task_id, cookie=r.m.task.cookie)
    assert (await stub.RenewLease(renew, metadata=md)).status == rpb.RUNNER_STATUS_DONE
    task = await r.m.device.get_task(r.job_id, late.cookie, wait_s=0.2)
    assert task.status == rpb.RUNNER_STATUS_DONE
    assert (await r.m.device.get_job("bad-input")).status == rpb.RUNNER_STATUS_DONE
    run = await r.store.get_current_run(r.job_id)
    m_results = [x for x in await r.store.list_results(run_id=run.run_id, accepted_only=False)]
    m_result = [x for x in m_results if x.device_id == r.m.device.device_id]
    assert len(m_result) == 1 and m_result[0].stale and not m_result[0].accepted  # recorded, not counted
    final = await download_model(r.control, r.job_id, r.admin)
    for name, value in fedavg(good).items():
        assert read_tensor(final.data[name]).tobytes() == value.tobytes(), name


async def test_a_cookie_of_an_expired_assignment_is_stale(tmp_path: Path) -> None:
    for attempt, lease_s in enumerate(LEASES_S):
        async with open_round(
            tmp_path / f"attempt-{attempt}",
            num_rounds=2,
            lease=timedelta(seconds=lease_s),
            reaper_interval=timedelta(milliseconds=100),
        ) as r:
            replies = [await send(r.a, report(r.job_id, r.a, update(1)))]
            replies.append(await send(r.b, report(r.job_id, r.b, update(2))))
            statuses = [reply.status for reply in replies]
            if statuses != [rpb.RUNNER_STATUS_OK] * 2 and lease_s != LEASES_S[-1]:
                continue  # A's or B's lease ran out before its report: once more, longer
            assert statuses == [rpb.RUNNER_STATUS_OK] * 2, replies
            await _check_a_cookie_of_an_expired_assignment_is_stale(r, lease_s)
            return


async def _check_a_cookie_of_an_expired_assignment_is_stale(r: Round, lease_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + lease_s + WAIT_S
    while loop.time() < deadline:  # M's lease runs out; the reaper expires it
        if (await r.store.get_assignment(r.m.task.assignment_id)).state is not AssignmentState.LEASED:
            break
        await asyncio.sleep(0.05)
    assert (await r.store.get_assignment(r.m.task.assignment_id)).state is AssignmentState.EXPIRED
    assert (await r.job()).state == states_pb2.JOB_STATE_RUNNING
    stub, md = r.m.device.stub, r.m.device.metadata
    renew = rpb.RenewLeaseRequest(job_id=r.job_id, task_id=r.m.task.task_id, cookie=r.m.task.cookie)
    assert (await stub.RenewLease(renew, metadata=md)).status == rpb.RUNNER_STATUS_STALE
    release = rpb.ReleaseAssignmentRequest(job_id=r.job_id, task_id=r.m.task.task_id, cookie=r.m.task.cookie)
    assert (await stub.ReleaseAssignment(release, metadata=md)).status == rpb.RUNNER_STATUS_STALE
    late = await send(r.m, report(r.job_id, r.m, update(3)))
    assert late.status == rpb.RUNNER_STATUS_STALE, late
    results = await r.store.list_results(task_id=r.m.task.task_id, accepted_only=False)
    assert [(x.stale, x.accepted, x.payload_sha256) for x in results] == [(True, False, None)]


@pytest.mark.parametrize("rpc", ["Enroll", "GetJob"])
@pytest.mark.parametrize(
    ("version", "code", "says"),
    [
        ("2.0", PRECONDITION, "upgrade the coordinator"),
        ("10.1", PRECONDITION, "upgrade the coordinator"),
        ("0.9", PRECONDITION, "upgrade the runner"),
        ("banana", INVALID, "MAJOR.MINOR"),
    ],
)
async def test_an_incompatible_protocol_version_says_what_to_upgrade(
    tmp_path: Path, rpc: str, version: str, code: grpc.StatusCode, says: str
) -> None:
    async with Coordinator(local_settings(tmp_path)) as coordinator:
        assert coordinator.endpoint is not None
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            device = await StubDevice(channel).enroll()
            if rpc == "Enroll":
                request = rpb.EnrollRequest(protocol_version=version, request_id=str(uuid.uuid4()))
                call: Awaitable[Any] = device.stub.Enroll(request)
            else:
                call = device.stub.GetJob(
                    rpb.GetJobRequest(protocol_version=version), metadata=device.metadata
                )
            await expect(call, code, version, says)


@dataclass(slots=True, kw_only=True)
class Operator:
    """A coordinator with no job yet, and the admin's stub."""

    coordinator: Coordinator
    control: cgrpc.ControlServiceAsyncStub
    runner: StubDevice
    admin: Metadata
    model_sha: str


@pytest.fixture
async def operator(tmp_path: Path) -> AsyncIterator[Operator]:
    async with Coordinator(local_settings(tmp_path)) as coordinator:
        assert coordinator.endpoint is not None
        admin = (("authorization", f"Bearer {coordinator.admin_token}"),)
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
            sha = await upload_model(control, weights_dxo(MODEL), admin)
            device = await StubDevice(channel).enroll()
            yield Operator(
                coordinator=coordinator, control=control, runner=device, admin=admin, model_sha=sha
            )


def _spec(sha: str, **fedavg: Any) -> cpb.JobSpec:
    spec = cpb.JobSpec(name="job", initial_model=dxo_pb2.BlobRef(sha256=sha))
    spec.fedavg.CopyFrom(cpb.FedAvgConfig(**{"num_rounds": 1, **fedavg}))
    return spec


async def _upload_bytes(o: Operator, data: bytes) -> str:
    sha = hashlib.sha256(data).hexdigest()
    parts = [
        cpb.UploadModelRequest(header=dxo_pb2.BlobUploadHeader(sha256=sha, size_bytes=len(data))),
        cpb.UploadModelRequest(chunk=data),
    ]
    await o.control.UploadModel(iter(parts), metadata=o.admin)
    return sha


async def test_malformed_job_submissions(operator: Operator) -> None:
    o = operator
    not_a_dxo = await _upload_bytes(o, b"\xff\xff\xff not a serialized Dxo")
    diff = weights_dxo(MODEL)
    diff.kind = dxo_pb2.DATA_KIND_WEIGHT_DIFF
    a_diff = await _upload_bytes(o, diff.SerializeToString())
    no_workflow = _spec(o.model_sha)
    no_workflow.ClearField("fedavg")
    negative_timeout = _spec(o.model_sha)
    negative_timeout.fedavg.round_timeout.FromSeconds(-5)
    cases: list[tuple[str, cpb.JobSpec, grpc.StatusCode, tuple[str, ...]]] = [
        ("no workflow", no_workflow, INVALID, ("workflow",)),
        ("num_rounds 0", _spec(o.model_sha, num_rounds=0), INVALID, ("num_rounds",)),
        ("fraction 2", _spec(o.model_sha, fraction=2.0), INVALID, ("fraction",)),
        ("negative min_results", _spec(o.model_sha, min_results=-1), INVALID, ("min_results",)),
        (
            "min_results over devices_per_round",
            _spec(o.model_sha, devices_per_round=2, min_results=3),
            INVALID,
            ("min_results",),
        ),
        ("negative round timeout", negative_timeout, INVALID, ("round_timeout",)),
        (
            "unknown failure policy",
            _spec(o.model_sha, round_failure_policy=7),
            INVALID,
            ("round_failure_policy",),
        ),
        ("job_data not JSON", _spec(o.model_sha), INVALID, ("job_data", "JSON")),
        ("job_data a JSON list", _spec(o.model_sha), INVALID, ("job_data", "object")),
        ("no name", _spec(o.model_sha), INVALID, ("name",)),
        ("no initial model", _spec(""), INVALID, ("initial model",)),
        ("initial model not a sha256", _spec("ABC"), INVALID, ("sha-256",)),
        ("unknown initial model", _spec(hashlib.sha256(b"x").hexdigest()), NOT_FOUND, ("not uploaded",)),
        ("initial model not a DXO", _spec(not_a_dxo), INVALID, ("Dxo",)),
        ("initial model not WEIGHTS", _spec(a_diff), INVALID, ("WEIGHTS",)),
    ]
    by_label = {label: spec for label, spec, _, _ in cases}
    by_label["job_data not JSON"].job_data = "{components: ["
    by_label["job_data a JSON list"].job_data = "[1, 2]"
    by_label["no name"].name = "  "
    failures: list[str] = []
    for label, spec, code, fragments in cases:
        call = o.control.SubmitJob(
            cpb.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4())), metadata=o.admin
        )
        try:
            await expect(call, code, *fragments)
        except AssertionError as error:
            failures.append(f"{label}: {error}")
    assert not failures, "\n".join(failures)
    listed = await o.control.ListJobs(cpb.ListJobsRequest(), metadata=o.admin)
    assert list(listed.jobs) == []


def _parts(
    data: bytes, *, sha: str, offset: int = 0, size: int | None = None
) -> Iterator[cpb.UploadModelRequest]:
    header = dxo_pb2.BlobUploadHeader(
        sha256=sha, size_bytes=len(data) if size is None else size, offset=offset
    )
    yield cpb.UploadModelRequest(header=header)
    for start in range(0, len(data), 1000):
        yield cpb.UploadModelRequest(chunk=data[start : start + 1000])


async def test_uploads_check_their_sha256_and_resume_only_where_they_stopped(operator: Operator) -> None:
    o = operator
    data = weights_dxo({"v": np.arange(1000, dtype=np.float32)}).SerializeToString()
    sha = hashlib.sha256(data).hexdigest()
    status = cpb.GetModelUploadStatusRequest(sha256=sha)
    # A mismatching hash: refused, and nothing committed.
    wrong = hashlib.sha256(b"something else").hexdigest()
    await expect(
        o.control.UploadModel(_parts(data, sha=wrong), metadata=o.admin), INVALID, "hash", "discarded"
    )
    wrong_status = await o.control.GetModelUploadStatus(
        cpb.GetModelUploadStatusRequest(sha256=wrong), metadata=o.admin
    )
    assert not wrong_status.complete
    await expect(o.control.SubmitJob(cpb.SubmitJobRequest(spec=_spec(wrong)), metadata=o.admin), NOT_FOUND)
    # The same on the device side.
    blob_header = dxo_pb2.BlobUploadHeader(sha256=wrong, size_bytes=len(data))
    blob_parts = [rpb.UploadBlobRequest(header=blob_header), rpb.UploadBlobRequest(chunk=data)]
    stub, md = o.runner.stub, o.runner.metadata
    await expect(stub.UploadBlob(iter(blob_parts), metadata=md), INVALID, "hash", "discarded")
    blob_status = await stub.GetBlobUploadStatus(rpb.GetBlobUploadStatusRequest(sha256=wrong), metadata=md)
    assert not blob_status.complete
    # A stream that stops early keeps what arrived and says where to resume.
    half = len(data) // 2
    await expect(
        o.control.UploadModel(_parts(data[:half], sha=sha, size=len(data)), metadata=o.admin),
        INVALID,
        str(half),
    )
    held = await o.control.GetModelUploadStatus(status, metadata=o.admin)
    assert (held.received_bytes, held.complete) == (half, False)
    # Resuming from the wrong offset names the right one and changes nothing.
    for offset in (0, half + 10):
        parts = _parts(data[offset:], sha=sha, offset=offset, size=len(data))
        await expect(o.control.UploadModel(parts, metadata=o.admin), INVALID, f"offset {half}")
    assert (await o.control.GetModelUploadStatus(status, metadata=o.admin)).received_bytes == half
    done = await o.control.UploadModel(
        _parts(data[half:], sha=sha, offset=half, size=len(data)), metadata=o.admin
    )
    assert done.model.sha256 == sha
    assert (await o.control.GetModelUploadStatus(status, metadata=o.admin)).complete
    # Streams that are not uploads.
    await expect(o.control.UploadModel(iter([]), metadata=o.admin), INVALID, "header")
    await expect(
        o.control.UploadModel(iter([cpb.UploadModelRequest(chunk=b"x")]), metadata=o.admin), INVALID, "header"
    )
    too_big = dxo_pb2.BlobUploadHeader(sha256=wrong, size_bytes=2**42)
    await expect(
        o.control.UploadModel(iter([cpb.UploadModelRequest(header=too_big)]), metadata=o.admin),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "limit",
    )
    extra = list(_parts(data, sha=wrong, size=10))
    await expect(o.control.UploadModel(iter(extra), metadata=o.admin), INVALID, "10 bytes")


async def test_deleting_a_live_job_is_refused_until_it_is_aborted(tmp_path: Path) -> None:
    async with open_round(tmp_path) as r:
        delete = cpb.DeleteJobRequest(job_id=r.job_id)
        await expect(r.control.DeleteJob(delete, metadata=r.admin), PRECONDITION, "abort")
        assert (await r.job()).state == states_pb2.JOB_STATE_RUNNING
        await finish_with_good_results(r)
        abort = cpb.AbortJobRequest(job_id=r.job_id)
        await expect(r.control.AbortJob(abort, metadata=r.admin), PRECONDITION, "finished")
        assert (await r.control.DeleteJob(delete, metadata=r.admin)).freed_bytes >= 0
        await expect(
            r.control.DescribeJob(cpb.DescribeJobRequest(job_id=r.job_id), metadata=r.admin), NOT_FOUND
        )
