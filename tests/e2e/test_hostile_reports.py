"""A hostile device over raw gRPC cannot make the coordinator build what its model does not have, hold
refused payloads, or fail with INTERNAL: each hostile input gets its precise status, costs no large
allocation, and the good devices' job still finishes with the right model."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from fedlink.server.app import Coordinator
from fedlink.server.domain import AssignmentState, TaskState
from fedlink.server.store import SqlStateStore
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import Metadata, StubDevice, dense, download_model, local_settings, read_tensor, upload_model
from .conftest import weights_dxo as model_dxo
from .test_bad_input import (
    INVALID,
    MODEL,
    PRECONDITION,
    Held,
    expect,
    finish_with_good_results,
    open_round,
    report,
    send,
    take_task,
    update,
)

MiB = 1024 * 1024
#: What a hostile tensor declares: 2**25 elements, 64 MiB as bfloat16 and 128 MiB as float32.
HUGE = 2**25
#: Allocation a refused report may cost at most: a small fraction of what it declares.
SMALL = 8 * MiB


@contextmanager
def traced() -> Iterator[None]:
    """Traces allocations (numpy's arrays too) for the block."""
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


async def peak_of(call: Awaitable[Any]) -> int:
    """How far traced memory rose above its level while ``call`` ran (inside :func:`traced`)."""
    tracemalloc.reset_peak()
    start = tracemalloc.get_traced_memory()[0]
    await call
    return tracemalloc.get_traced_memory()[1] - start


async def refused_peak(call: Awaitable[Any], code: grpc.StatusCode, *fragments: str) -> int:
    """Awaits a call that must fail with ``code`` (see ``expect``); returns its allocation peak."""
    return await peak_of(expect(call, code, *fragments))


def sparse(name: str, dtype: str, shape: list[int]) -> dxo_pb2.Dxo:
    """A WEIGHT_DIFF whose one tensor declares ``shape`` and carries no value: a few dozen bytes."""
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    dxo.data[name].CopyFrom(dxo_pb2.Tensor(dtype=dtype, shape=shape, sparse=dxo_pb2.SparseEncoding()))
    dxo.meta["num_examples"].int_value = 1
    return dxo


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


async def test_a_tiny_report_declaring_a_huge_tensor_is_refused_before_it_is_built(tmp_path: Path) -> None:
    async with open_round(tmp_path) as r:
        hostile = [
            # The 47-byte report: a sparse bfloat16 tensor of a model variable, of another shape.
            (sparse("w", "bfloat16", [HUGE]), ("'w'", "shape", f"({HUGE},)", "(2, 3)")),
            (sparse("w", "float32", [2, HUGE]), ("'w'", "shape")),
            (sparse("w", "float64", [2, 3]), ("'w'", "dtype", "float64", "float32")),
            (sparse("zzz", "float32", [HUGE]), ("'zzz'", "not part of the model")),
        ]
        with traced():
            for dxo, fragments in hostile:
                assert dxo.ByteSize() < 64
                peak = await refused_peak(send(r.m, report(r.job_id, r.m, dxo)), INVALID, *fragments)
                assert peak < SMALL, f"{fragments}: refusing it allocated {peak / MiB:.0f} MiB"
            # The same as an uploaded blob: refused as it is read, before anything is decoded.
            data = sparse("w", "bfloat16", [HUGE]).SerializeToString()
            sha = hashlib.sha256(data).hexdigest()
            header = dxo_pb2.BlobUploadHeader(sha256=sha, size_bytes=len(data))
            parts = [rpb.UploadBlobRequest(header=header), rpb.UploadBlobRequest(chunk=data)]
            await r.m.device.stub.UploadBlob(iter(parts), metadata=r.m.device.metadata)
            by_blob = report(r.job_id, r.m, None)
            by_blob.result.blob.sha256, by_blob.result.blob.size_bytes = sha, len(data)
            peak = await refused_peak(send(r.m, by_blob), INVALID, "'w'", "shape")
            assert peak < SMALL, f"refusing the blob allocated {peak / MiB:.0f} MiB"
        # Nothing was stored, M still holds its task, and the round ends with the good devices' average.
        assert (await r.store.get_assignment(r.m.task.assignment_id)).state is AssignmentState.LEASED
        assert not await r.store.list_results(task_id=r.m.task.task_id, accepted_only=False)
        await finish_with_good_results(r)


async def test_a_sparse_tensor_has_no_more_indices_than_elements(tmp_path: Path) -> None:
    async with open_round(tmp_path) as r:
        dxo = update(9)
        indices = np.array([0, 1, 2, 3, 4, 5, 5], "<i8")  # seven, in range, for the six elements of 'w'
        dxo.data["w"].CopyFrom(
            dxo_pb2.Tensor(
                dtype="float32",
                shape=[2, 3],
                sparse=dxo_pb2.SparseEncoding(indices=indices.tobytes(), values=np.ones(7, "<f4").tobytes()),
            )
        )
        await expect(send(r.m, report(r.job_id, r.m, dxo)), INVALID, "'w'", "7 sparse indices", "6 elements")
        await finish_with_good_results(r)


def _with_meta(**values: dxo_pb2.MetaValue) -> dxo_pb2.Dxo:
    dxo = update(9)
    for key, value in values.items():
        dxo.meta[key].CopyFrom(value)
    return dxo


async def test_a_dxos_structure_is_bounded(tmp_path: Path) -> None:
    async with open_round(tmp_path) as r:
        extra = update(9)
        extra.data["extra"].CopyFrom(dense(np.zeros(3, np.float32)))
        many_meta = update(9)
        for i in range(1_000):
            many_meta.meta[f"m{i}"].int_value = i
        cases: list[tuple[str, dxo_pb2.Dxo, tuple[str, ...]]] = [
            ("more tensors than the model", extra, ("'extra'", "carries 3 variables", "the model 2")),
            ("1,001 meta entries", many_meta, ("limit of 1000 meta entries",)),
            # Nested 10,000 deep, json.loads raised RecursionError: INTERNAL.
            (
                "JSON nested 10,000 deep",
                _with_meta(cfg=dxo_pb2.MetaValue(json_value=nested(10_000))),
                ("'cfg'", "10000 deep", "limit of 64"),
            ),
            (
                "JSON nested 65 deep",
                _with_meta(cfg=dxo_pb2.MetaValue(json_value=nested(65))),
                ("'cfg'", "65 deep", "limit of 64"),
            ),
        ]
        failures: list[str] = []
        for label, dxo, fragments in cases:
            try:
                await expect(send(r.m, report(r.job_id, r.m, dxo)), INVALID, *fragments)
            except AssertionError as error:
                failures.append(f"{label}: {error}")
        assert not failures, "\n".join(failures)
        await finish_with_good_results(r)


async def test_job_data_is_bounded_in_depth_and_size(tmp_path: Path) -> None:
    async with Coordinator(local_settings(tmp_path)) as coordinator:
        assert coordinator.endpoint is not None
        admin: Metadata = (("authorization", f"Bearer {coordinator.admin_token}"),)
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
            sha = await upload_model(control, model_dxo(MODEL), admin)

            def spec(job_data: str) -> cpb.SubmitJobRequest:
                job = cpb.JobSpec(name="job", initial_model=dxo_pb2.BlobRef(sha256=sha), job_data=job_data)
                job.fedavg.num_rounds = 1
                return cpb.SubmitJobRequest(spec=job, request_id=str(uuid.uuid4()))

            deep = '{"components": ' + nested(10_000) + "}"
            await expect(control.SubmitJob(spec(deep), metadata=admin), INVALID, "job_data", "limit of 64")
            large = '{"note": "' + "x" * (1024 * 1024) + '"}'
            await expect(
                control.SubmitJob(spec(large), metadata=admin), INVALID, "job_data", "limit of 1048576 bytes"
            )
            assert list((await control.ListJobs(cpb.ListJobsRequest(), metadata=admin)).jobs) == []
            # 60 deep is within the limit: whatever else is said of this job_data, not its depth.
            fine = '{"components": ' + nested(60) + "}"
            try:
                assert (await control.SubmitJob(spec(fine), metadata=admin)).job.job_id
            except grpc.aio.AioRpcError as error:
                assert "deep" not in (error.details() or ""), error.details()


async def test_durations_out_of_range_are_invalid_argument_and_log_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_round(tmp_path) as r:
        stub, md = r.m.device.stub, r.m.device.metadata
        with caplog.at_level(logging.ERROR):
            for seconds, nanos in ((10**18, 0), (10**12, 0), (-(10**18), 0), (1, 2 * 10**9), (1, -5)):
                request = rpb.GetTaskRequest(job_id=r.job_id, cookie=r.m.task.cookie)
                request.wait_timeout.seconds, request.wait_timeout.nanos = seconds, nanos
                await expect(stub.GetTask(request, metadata=md), INVALID, "wait_timeout", "out of range")
            for workflow, path in (("fedavg", "spec.fedavg"), ("fedadam", "spec.fedadam.rounds")):
                spec = cpb.JobSpec(name="job", initial_model=dxo_pb2.BlobRef(sha256="0" * 64))
                rounds = getattr(spec, workflow)
                rounds = rounds if workflow == "fedavg" else rounds.rounds
                rounds.num_rounds = 1
                rounds.round_timeout.seconds = 10**13  # a timedelta holds it; a Duration does not
                submit = r.control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=r.admin)
                await expect(submit, INVALID, f"{path}.round_timeout", "out of range")
        assert not [x for x in caplog.records if x.levelno >= logging.ERROR], caplog.text
        # A wait in range is served: M gets its task again.
        again = await r.m.device.get_task(r.job_id, r.m.task.cookie, wait_s=0.2)
        assert again.assignment_id == r.m.task.assignment_id
        await finish_with_good_results(r)


async def test_a_report_for_an_assignment_that_is_not_open_is_not_decoded(tmp_path: Path) -> None:
    async with open_round(tmp_path, num_rounds=2, round_timeout_s=2) as r:
        first = report(r.job_id, r.a, update(1, 30))
        assert (await send(r.a, first)).status == rpb.RUNNER_STATUS_OK
        nan = update(5)
        nan.data["w"].CopyFrom(dense(np.full((2, 3), np.nan, np.float32)))
        # A's assignment is completed: a different report conflicts, whatever it carries (decoded, the
        # first would be INVALID_ARGUMENT, the second would have been built: 64 MiB).
        with traced():
            for dxo in (nan, sparse("w", "bfloat16", [HUGE])):
                peak = await refused_peak(
                    send(r.a, report(r.job_id, r.a, dxo)), PRECONDITION, "different result"
                )
                assert peak < SMALL, f"refusing it allocated {peak / MiB:.0f} MiB"
        assert (await send(r.a, first)).status == rpb.RUNNER_STATUS_OK  # a retry: the original reply
        assert (await send(r.b, report(r.job_id, r.b, update(2, 70)))).status == rpb.RUNNER_STATUS_OK
        # The deadline closes round 1 without M: its late report is recorded as stale, not decoded.
        for _ in range(200):
            if (await r.store.get_task(r.m.task.task_id)).state is not TaskState.OPEN:
                break
            await asyncio.sleep(0.05)
        late = await send(r.m, report(r.job_id, r.m, nan))
        assert late.status == rpb.RUNNER_STATUS_STALE, late
        results = await r.store.list_results(task_id=r.m.task.task_id, accepted_only=False)
        assert [(x.stale, x.accepted, x.payload_sha256) for x in results] == [(True, False, None)]
        # Round 2 runs on.
        for held in (r.a, r.b):
            second = await take_task(held.device, r.job_id)
            assert second.task.round == 2
            assert (await send(second, report(r.job_id, second, update(3)))).status == rpb.RUNNER_STATUS_OK
        assert (await r.wait_for_state(states_pb2.JOB_STATE_FINISHED)).current_round == 2


BIG = {"w": np.zeros(1 << 20, np.float32)}  # 4 MiB


@dataclass(slots=True, kw_only=True)
class BigRound:
    coordinator: Coordinator
    control: cgrpc.ControlServiceAsyncStub
    admin: Metadata
    job_id: str
    a: Held
    m: Held

    @property
    def store(self) -> SqlStateStore:
        assert self.coordinator.store is not None
        return self.coordinator.store


@asynccontextmanager
async def big_round(tmp_path: Path, **settings: Any) -> AsyncIterator[BigRound]:
    """A coordinator whose one-round job over a 4 MiB model sampled A and M and needs both."""
    async with Coordinator(local_settings(tmp_path, **settings)) as coordinator:
        assert coordinator.endpoint is not None
        admin: Metadata = (("authorization", f"Bearer {coordinator.admin_token}"),)
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
            devices = [await StubDevice(channel).enroll() for _ in range(2)]
            for device in devices:  # runners ask for work first: only devices that asked are sampled
                await device.get_job()
            sha = await upload_model(control, model_dxo(BIG), admin)
            spec = cpb.JobSpec(name="big", initial_model=dxo_pb2.BlobRef(sha256=sha))
            spec.fedavg.num_rounds = 1
            spec.fedavg.min_devices = 2
            spec.fedavg.min_results = 2
            spec.fedavg.round_timeout.FromSeconds(60)
            job = (await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)).job
            a, m = [await take_task(d, job.job_id) for d in devices]
            yield BigRound(coordinator=coordinator, control=control, admin=admin, job_id=job.job_id, a=a, m=m)


def big_update(value: float, num_examples: int = 1) -> dxo_pb2.Dxo:
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    dxo.data["w"].CopyFrom(dense(np.full(BIG["w"].shape, value, np.float32)))
    dxo.meta["num_examples"].int_value = num_examples
    return dxo


async def test_refused_payloads_are_freed_at_once(tmp_path: Path) -> None:
    async with big_round(tmp_path) as r:
        assert (await send(r.a, report(r.job_id, r.a, big_update(1.0)))).status == rpb.RUNNER_STATUS_OK
        nan = big_update(0.0)
        nan.data["w"].CopyFrom(dense(np.where(np.arange(1 << 20) == 7, np.nan, 0).astype(np.float32)))
        # Reference counting alone must free a refused report: no cycle may hold it (the collector
        # runs rarely on a busy coordinator, see gc_tuning).
        gc.collect()
        gc.disable()
        try:
            with traced():
                before = tracemalloc.get_traced_memory()[0]
                for i in range(6):
                    # Decoded and refused (M's assignment is open), and refused by the store (A's is not).
                    await expect(send(r.m, report(r.job_id, r.m, nan)), INVALID, "'w'", "NaN")
                    await expect(
                        send(r.a, report(r.job_id, r.a, big_update(2.0 + i))), PRECONDITION, "different"
                    )
                # The client hears the status a loop iteration before the server's call has ended.
                await asyncio.sleep(0.05)
                held = tracemalloc.get_traced_memory()[0] - before
        finally:
            gc.enable()
        assert held < 4 * MiB, f"12 refused reports of 4 MiB left {held / MiB:.1f} MiB allocated"
        # M's good report still counts: the model is the average of A's and M's.
        assert (await send(r.m, report(r.job_id, r.m, big_update(3.0)))).status == rpb.RUNNER_STATUS_OK
        for _ in range(300):
            job = await r.control.DescribeJob(cpb.DescribeJobRequest(job_id=r.job_id), metadata=r.admin)
            if job.job.state == states_pb2.JOB_STATE_FINISHED:
                break
            await asyncio.sleep(0.05)
        final = read_tensor((await download_model(r.control, r.job_id, r.admin)).data["w"])
        assert np.all(final == np.float32(2.0))


async def test_a_large_report_for_an_expired_assignment_is_not_decoded(tmp_path: Path) -> None:
    # This coordinator does not know the lease ended (the reaper expired it in the store): a payload
    # this large is decoded only once the store says the assignment is open.
    async with big_round(
        tmp_path, lease=timedelta(seconds=1), reaper_interval=timedelta(milliseconds=100)
    ) as r:
        for _ in range(200):
            if (await r.store.get_assignment(r.m.task.assignment_id)).state is not AssignmentState.LEASED:
                break
            await asyncio.sleep(0.05)
        nan = big_update(0.0)
        nan.data["w"].CopyFrom(dense(np.full(BIG["w"].shape, np.nan, np.float32)))
        late = await send(r.m, report(r.job_id, r.m, nan))  # decoded, it would be INVALID_ARGUMENT
        # STALE, or DONE if the job has ended meanwhile (both leases expired: on a loaded machine the
        # round may give up before the report arrives); either way recorded, never decoded.
        assert late.status in (rpb.RUNNER_STATUS_STALE, rpb.RUNNER_STATUS_DONE), late
        assert late.message == "recorded, not aggregated", late
        results = await r.store.list_results(task_id=r.m.task.task_id, accepted_only=False)
        assert [(x.stale, x.accepted, x.payload_sha256) for x in results] == [(True, False, None)]


@asynccontextmanager
async def evaluation(tmp_path: Path) -> AsyncIterator[tuple[BigRound, Held]]:
    """A one-round job with evaluation whose devices A and M trained; A holds its evaluate task."""
    async with Coordinator(local_settings(tmp_path)) as coordinator:
        assert coordinator.endpoint is not None
        admin: Metadata = (("authorization", f"Bearer {coordinator.admin_token}"),)
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel)
            devices = [await StubDevice(channel).enroll() for _ in range(2)]
            for device in devices:  # runners ask for work first: only devices that asked are sampled
                await device.get_job()
            sha = await upload_model(control, model_dxo(MODEL), admin)
            spec = cpb.JobSpec(name="evaluated", initial_model=dxo_pb2.BlobRef(sha256=sha))
            spec.fedavg.num_rounds = 1
            spec.fedavg.min_devices = 2
            spec.fedavg.min_results = 2
            spec.fedavg.evaluate = True
            spec.fedavg.round_timeout.FromSeconds(60)
            job = (await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)).job
            a, m = [await take_task(d, job.job_id) for d in devices]
            for held, seed in ((a, 1), (m, 2)):
                assert (
                    await send(held, report(job.job_id, held, update(seed)))
                ).status == rpb.RUNNER_STATUS_OK
            evaluate = await take_task(a.device, job.job_id)
            assert evaluate.task.task_name == "evaluate"
            fleet = BigRound(
                coordinator=coordinator, control=control, admin=admin, job_id=job.job_id, a=a, m=m
            )
            yield fleet, evaluate


def metrics(**values: float) -> dxo_pb2.Dxo:
    """A METRICS DXO of 0-d float64 tensors, as the built-in executors send."""
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_METRICS)
    for name, value in values.items():
        data = dxo_pb2.DenseEncoding(data=np.float64(value).astype("<f8").tobytes())
        dxo.data[name].CopyFrom(dxo_pb2.Tensor(dtype="float64", dense=data))
    dxo.meta["num_examples"].int_value = 10
    return dxo


async def test_evaluation_results_are_bounded_before_they_are_decoded(tmp_path: Path) -> None:
    async with evaluation(tmp_path) as (r, held):
        huge = metrics()
        huge.data["loss"].CopyFrom(
            dxo_pb2.Tensor(dtype="float64", shape=[HUGE], sparse=dxo_pb2.SparseEncoding())
        )
        many = metrics(**{f"m{i}": 1.0 for i in range(1_001)})
        with traced():
            peak = await refused_peak(
                send(held, report(r.job_id, held, huge)), INVALID, "decode to", "more than the limit"
            )
            assert peak < SMALL, f"refusing it allocated {peak / MiB:.0f} MiB"
        await expect(send(held, report(r.job_id, held, many)), INVALID, "1001 tensors", "limit of 1000")
        await expect(send(held, report(r.job_id, held, update(3))), INVALID, "must be METRICS")
        good = metrics(loss=0.5, accuracy=0.75)
        assert (await send(held, report(r.job_id, held, good))).status == rpb.RUNNER_STATUS_OK
        other = await take_task(r.m.device, r.job_id)
        assert (await send(other, report(r.job_id, other, good))).status == rpb.RUNNER_STATUS_OK
        for _ in range(300):
            job = (await r.control.DescribeJob(cpb.DescribeJobRequest(job_id=r.job_id), metadata=r.admin)).job
            if job.state == states_pb2.JOB_STATE_FINISHED:
                break
            await asyncio.sleep(0.05)
        assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
        assert job.metrics["eval_loss"] == pytest.approx(0.5)
