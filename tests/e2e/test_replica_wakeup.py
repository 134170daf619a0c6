"""Two coordinators on one PostgreSQL database: a task the driver creates on replica A answers a device's
long poll on replica B at once, not when B's poll would have timed out (issue 17).

Real coordinators on 127.0.0.1:0, each with its own data directory, blob bytes in the shared database;
the device speaks the generated stubs only.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from fedlink.server.app import Coordinator
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import StubDevice, local_settings, upload_model, weights_dxo

pytestmark = pytest.mark.postgres

#: The device's long poll: without a wake-up from A it would be answered only after this.
MAX_TASK_WAIT_S = 20


def replica_settings(tmp_path: Path, name: str, db_url: str, **overrides: Any) -> Any:
    return local_settings(
        tmp_path,
        data_dir=tmp_path / name,
        db_url=db_url,
        admin_token="one token for both",
        blobs_in_database=True,
        max_task_wait=timedelta(seconds=MAX_TASK_WAIT_S),
        **overrides,
    )


async def test_a_task_created_on_one_replica_answers_a_long_poll_on_the_other_at_once(
    pg_database: str, tmp_path: Path
) -> None:
    async with Coordinator(replica_settings(tmp_path, "a", pg_database, auto_migrate=True)) as a:
        assert a.endpoint is not None and a.store is not None
        admin = (("authorization", f"Bearer {a.admin_token}"),)
        async with grpc.aio.insecure_channel(a.endpoint.address) as channel_a:
            control: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel_a)
            spec = cpb.JobSpec(name="wakeup", initial_model=dxo_pb2.BlobRef(sha256=""))
            spec.initial_model.sha256 = await upload_model(
                control, weights_dxo({"w": np.zeros(3, np.float32)}), admin
            )
            # Two devices per round: the round (and its tasks) starts only once the second device, on
            # A, asks for work, after the first one's long poll on B has begun.
            spec.fedavg.num_rounds = 1
            spec.fedavg.devices_per_round = 2
            spec.fedavg.round_timeout.FromSeconds(120)
            job_id = (await control.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)).job.job_id
            # A drives the job: it is RUNNING before B exists.
            async with asyncio.timeout(30):
                while True:
                    job = (
                        await control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=admin)
                    ).job
                    if job.state == states_pb2.JOB_STATE_RUNNING:
                        break
                    await asyncio.sleep(0.05)

            async with (
                Coordinator(replica_settings(tmp_path, "b", pg_database)) as b,
                grpc.aio.insecure_channel(b.endpoint.address if b.endpoint else "") as channel_b,
            ):
                on_b = await StubDevice(channel_b).enroll()
                assert (await on_b.get_job()).job_id == job_id
                began = time.time()
                poll = asyncio.create_task(on_b.get_task(job_id, wait_s=MAX_TASK_WAIT_S))
                await asyncio.sleep(0.5)  # B's long poll is waiting (not required for the asserts)
                assert not poll.done(), poll
                on_a = await StubDevice(channel_a).enroll()
                assert (await on_a.get_job()).job_id == job_id
                reply = await asyncio.wait_for(poll, MAX_TASK_WAIT_S + 10)
                answered = time.time()
                task = await a.store.get_task(reply.task_id) if reply.task_id else None

    assert reply.status == rpb.RUNNER_STATUS_OK, reply
    assert task is not None
    created = task.created_at.timestamp()
    assert created > began, "the task existed before B's long poll began: the poll proves nothing"
    took = answered - created
    print(f"\ntask created on A -> answered on B: {took * 1000:.0f} ms")
    # Woken by A's notification, not by the end of the wait (MAX_TASK_WAIT_S after the poll began).
    assert took < MAX_TASK_WAIT_S / 2, f"B answered {took:.1f}s after the task was created on A"
