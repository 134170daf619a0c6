"""Two coordinators on one PostgreSQL database: results reported to the replica that does not drive the
job reach the driver's fold while the round is open, so that its close reads none of them back
(issue 17: the multi-process experiment lost to exactly that read at the close).

Real coordinators on 127.0.0.1:0 in this process, each with its own data directory, blob bytes in the
shared database; the devices speak the generated stubs only, all to replica B, while A drives.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedlink.server.app import Coordinator
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import StubDevice, dense, download_model, read_tensor, upload_model, weights_dxo
from .test_replica_wakeup import replica_settings

pytestmark = pytest.mark.postgres

DEVICES = 4
ROUNDS = 3


def update(device: int, round_no: int) -> dxo_pb2.Dxo:
    diff = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    diff.data["w"].CopyFrom(dense(np.full(3, (device + 1) * 0.25 + round_no, np.float32)))
    diff.meta["num_examples"].int_value = device + 1
    return diff


async def test_results_reported_to_another_replica_reach_the_drivers_fold_before_the_close(
    pg_database: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="fedlink.server.workflows.folding")
    async with Coordinator(replica_settings(tmp_path, "a", pg_database, auto_migrate=True)) as a:
        assert a.endpoint is not None
        admin = (("authorization", f"Bearer {a.admin_token}"),)
        async with grpc.aio.insecure_channel(a.endpoint.address) as channel_a:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel_a)
            sha = await upload_model(control, weights_dxo({"w": np.zeros(3, np.float32)}), admin)
            spec = cpb.JobSpec(name="elsewhere", initial_model=dxo_pb2.BlobRef(sha256=sha))
            spec.fedavg.num_rounds = ROUNDS
            spec.fedavg.devices_per_round = DEVICES
            spec.fedavg.round_timeout.FromSeconds(120)
            job_id = (await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)).job.job_id
            async with asyncio.timeout(30):  # A drives the job: it is RUNNING before B exists
                while True:
                    request = cpb.DescribeJobRequest(job_id=job_id)
                    if (
                        await control.DescribeJob(request, metadata=admin)
                    ).job.state == states_pb2.JOB_STATE_RUNNING:
                        break
                    await asyncio.sleep(0.05)

            async with (
                Coordinator(replica_settings(tmp_path, "b", pg_database)) as b,
                grpc.aio.insecure_channel(b.endpoint.address if b.endpoint else "") as channel_b,
            ):
                devices = [await StubDevice(channel_b).enroll() for _ in range(DEVICES)]
                for device in devices:
                    assert (await device.get_job()).job_id == job_id
                for round_no in range(1, ROUNDS + 1):
                    tasks = [await device.get_task(job_id, wait_s=20) for device in devices]
                    assert [t.status for t in tasks] == [rpb.RUNNER_STATUS_OK] * DEVICES, round_no
                    for i, (device, task) in enumerate(zip(devices, tasks, strict=True)):
                        reply = await device.report(job_id, task, update(i, round_no))
                        assert reply.status == rpb.RUNNER_STATUS_OK
                        await asyncio.sleep(0.2)  # the round stays open a while after each report
                watch = control.WatchJob(cpb.WatchJobRequest(job_id=job_id), metadata=admin, timeout=60)
                events = [event async for event in watch]
                model = await download_model(control, job_id, admin)

    assert events[-1].state == states_pb2.JOB_STATE_FINISHED
    closed = [e for e in events if e.WhichOneof("event") == "round_closed"]
    assert [e.round_closed.num_results for e in closed] == [DEVICES] * ROUNDS
    weights = np.arange(1, DEVICES + 1, dtype=np.float64)
    steps = [np.average([(i + 1) * 0.25 + r for i in range(DEVICES)], weights=weights) for r in (1, 2, 3)]
    np.testing.assert_allclose(read_tensor(model.data["w"]), np.full(3, sum(steps)), rtol=1e-6)
    reads = [r.getMessage() for r in caplog.records if "round close reads" in r.getMessage()]
    assert reads == [], f"the driver read results back at the close: {reads}"
