"""Cross-replica long-poll wake-up: from a task's creation on replica A to a device's answer on replica B.

Two in-process coordinators share one fresh PostgreSQL database (each with its own data directory, blob
bytes in the database). A FedAvg job with two devices per round is driven by A. One device long-polls
GetTask on B (the cross-replica path: A's NOTIFY, B's listener, B's claim), the other on A (the
baseline: A's in-process wake-up and claim). Both poll again as soon as they reported, before A has
aggregated the round and created the next round's tasks, so each round gives one sample of each path
from the same instant.

Latency = the device's answer (wall clock, client side) minus the task's ``created_at`` (stored by A,
same machine and clock). Rounds whose task existed before a poll began are counted but left out of the
figures (that poll did not wait for a wake-up).

The round closes when A's driver sees both results. A result reported on B reaches A's driver by B's
relay (NOTIFY, as tasks do); the device on B still reports first and the device on A second, so that
A's own report closes the round and the next round's tasks do not wait for a relay.

    python bench/replica_wakeup_bench.py [--rounds 50] [--quick] [--json out.json] [--db-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np

if __package__ in (None, ""):
    # Run as a script (``python bench/replica_wakeup_bench.py``): bench/ is on the path, not the checkout.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedlink.common.dxo import DXO, DataKind
from fedlink.common.version import PROTOCOL_VERSION
from fedlink.server.app import Coordinator
from fedlink.server.settings import CoordinatorSettings
from fedlink.server.store.sql import SqlStateStore
from fedlink.server.store.testing import create_pg_database, drop_pg_database
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb
from fedlink.v1 import runner_service_pb2_grpc as rgrpc

PG_ADMIN_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
MAX_TASK_WAIT_S = 20
ADMIN_TOKEN = "replica wakeup bench"


@dataclass
class Samples:
    """One device's wake-ups, in seconds from the task's creation to its answer."""

    latencies: list[float] = field(default_factory=list)
    #: Rounds whose task already existed when the poll began (left out of the latencies).
    not_waiting: int = 0

    def summary(self) -> dict[str, float]:
        values = sorted(self.latencies)
        if not values:
            return {"n": 0}
        cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
        return {
            "n": len(values),
            "p50_ms": statistics.median(values) * 1000,
            "p99_ms": cuts[98] * 1000,
            "max_ms": values[-1] * 1000,
        }


class Device:
    """A device speaking RunnerService through the generated stubs."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub: rgrpc.RunnerServiceAsyncStub = rgrpc.RunnerServiceStub(channel)
        self.metadata: tuple[tuple[str, str], ...] = ()

    async def enroll(self) -> None:
        reply = await self.stub.Enroll(
            rpb.EnrollRequest(
                protocol_version=PROTOCOL_VERSION, request_id=str(uuid.uuid4()), device_info={"b": "1"}
            )
        )
        self.metadata = (("authorization", f"Bearer {reply.device_credential}"),)

    async def job(self, name: str) -> str:
        request = rpb.GetJobRequest(job_name=name, protocol_version=PROTOCOL_VERSION)
        while True:
            reply = await self.stub.GetJob(request, metadata=self.metadata)
            if reply.status == rpb.RUNNER_STATUS_OK:
                return str(reply.job_id)
            await asyncio.sleep(0.05)

    async def task(self, job_id: str) -> tuple[rpb.GetTaskResponse, float, float]:
        """The next task (skipping RETRY), with when the answering poll began and ended (wall clock)."""
        while True:
            request = rpb.GetTaskRequest(job_id=job_id)
            request.wait_timeout.FromSeconds(MAX_TASK_WAIT_S)
            began = time.time()
            reply = await self.stub.GetTask(request, metadata=self.metadata, timeout=MAX_TASK_WAIT_S + 30)
            if reply.status != rpb.RUNNER_STATUS_RETRY:
                return reply, began, time.time()

    async def report(self, job_id: str, task: rpb.GetTaskResponse) -> None:
        diff = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
        for name, tensor in task.task_data.dxo.data.items():
            diff.data[name].CopyFrom(tensor)
        diff.meta["num_examples"].int_value = 1
        request = rpb.ReportResultRequest(
            job_id=job_id,
            task_id=task.task_id,
            cookie=task.cookie,
            status=states_pb2.RESULT_STATUS_SUCCEEDED,
            request_id=str(uuid.uuid4()),
        )
        request.result.dxo.CopyFrom(diff)
        reply = await self.stub.ReportResult(request, metadata=self.metadata)
        if reply.status != rpb.RUNNER_STATUS_OK:
            raise RuntimeError(f"report answered {rpb.RunnerStatus.Name(reply.status)}")


def settings(root: Path, name: str, db_url: str, **overrides: Any) -> CoordinatorSettings:
    return CoordinatorSettings(
        data_dir=root / name,
        listen_address="127.0.0.1:0",
        insecure=True,
        open_enrolment=True,
        db_url=db_url,
        admin_token=ADMIN_TOKEN,
        blobs_in_database=True,
        max_task_wait=timedelta(seconds=MAX_TASK_WAIT_S),
        **overrides,
    )


@contextlib.asynccontextmanager
async def channel(coordinator: Coordinator) -> AsyncIterator[grpc.aio.Channel]:
    assert coordinator.endpoint is not None
    async with grpc.aio.insecure_channel(coordinator.endpoint.address) as opened:
        yield opened


async def submit(channel_a: grpc.aio.Channel, rounds: int) -> str:
    control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel_a)
    admin = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
    data = DXO(kind=DataKind.WEIGHTS, data={"w": np.zeros(4, np.float32)}).to_bytes()
    sha = hashlib.sha256(data).hexdigest()
    header = dxo_pb2.BlobUploadHeader(sha256=sha, size_bytes=len(data), offset=0)
    await control.UploadModel(
        iter([cpb.UploadModelRequest(header=header), cpb.UploadModelRequest(chunk=data)]), metadata=admin
    )
    spec = cpb.JobSpec(name="wakeup-bench", initial_model=dxo_pb2.BlobRef(sha256=sha))
    spec.fedavg.num_rounds = rounds
    spec.fedavg.devices_per_round = 2
    spec.fedavg.round_timeout.FromSeconds(300)
    spec.fedavg.pickup_timeout.FromSeconds(300)
    reply = await control.SubmitJob(
        cpb.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4())), metadata=admin
    )
    job_id = str(reply.job.job_id)
    while True:  # driven by A: RUNNING before B starts
        job = (await control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=admin)).job
        if job.state == states_pb2.JOB_STATE_RUNNING:
            return job_id
        await asyncio.sleep(0.05)


async def measure(db_url: str, rounds: int) -> dict[str, Samples]:
    samples = {"on B (cross-replica)": Samples(), "on A (baseline)": Samples()}
    with tempfile.TemporaryDirectory(prefix="fedlink-wakeup-") as tmp:
        root = Path(tmp)
        async with Coordinator(settings(root, "a", db_url, auto_migrate=True)) as a, channel(a) as channel_a:
            job_id = await submit(channel_a, rounds)
            async with Coordinator(settings(root, "b", db_url)) as b, channel(b) as channel_b:
                remote, local = Device(channel_b), Device(channel_a)
                for device in (remote, local):
                    await device.enroll()
                    await device.job("wakeup-bench")
                assert a.store is not None
                store = a.store
                for round_no in range(1, rounds + 1):
                    remote_poll = asyncio.create_task(remote.task(job_id))
                    local_poll = asyncio.create_task(local.task(job_id))
                    got = {}
                    for name, poll, device in (
                        ("on B (cross-replica)", remote_poll, remote),
                        ("on A (baseline)", local_poll, local),
                    ):
                        reply, began, answered = await poll
                        if reply.status != rpb.RUNNER_STATUS_OK:
                            raise RuntimeError(f"round {round_no}: {rpb.RunnerStatus.Name(reply.status)}")
                        await record(store, samples[name], reply.task_id, began, answered)
                        got[name] = (device, reply)
                    # B's device first: A's own device's report then closes the round at once.
                    for device, reply in got.values():
                        await device.report(job_id, reply)
                    print(f"round {round_no}/{rounds} done", end="\r", flush=True)
    print()
    return samples


async def record(store: SqlStateStore, samples: Samples, task_id: str, began: float, answered: float) -> None:
    created = (await store.get_task(task_id)).created_at.timestamp()
    if created <= began:
        samples.not_waiting += 1
    else:
        samples.latencies.append(answered - created)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=50, help="rounds (one sample per device each)")
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--db-url", help="an empty PostgreSQL database to use (default: a fresh one, dropped afterwards)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds = 5
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    db_url = args.db_url or create_pg_database(PG_ADMIN_URL, prefix="fedlink_wakeup_bench")
    try:
        samples = asyncio.run(measure(db_url, args.rounds))
    finally:
        if not args.db_url:
            drop_pg_database(PG_ADMIN_URL, db_url)
    figures = {name: s.summary() | {"not_waiting": s.not_waiting} for name, s in samples.items()}
    print(f"task created on A -> GetTask answered; {args.rounds} rounds, max_task_wait {MAX_TASK_WAIT_S}s")
    print(f"{'device':24} {'n':>4} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'not waiting':>11}")
    for name, f in figures.items():
        if f["n"]:
            print(
                f"{name:24} {f['n']:>4.0f} {f['p50_ms']:>8.1f} {f['p99_ms']:>8.1f} {f['max_ms']:>8.1f}"
                f" {f['not_waiting']:>11.0f}"
            )
        else:
            print(f"{name:24} {0:>4} {'-':>8} {'-':>8} {'-':>8} {f['not_waiting']:>11.0f}")
    remote, local = figures["on B (cross-replica)"], figures["on A (baseline)"]
    if remote["n"] and local["n"]:
        print(f"p50 on B / p50 on A: {remote['p50_ms'] / local['p50_ms']:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({"rounds": args.rounds, "figures": figures}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
