"""deploy/compose.yaml's two coordinator replicas, run as compose configures them (each service's
environment, TLS and secret files from deploy/make_secrets.py, a data directory each) on one PostgreSQL
database migrated first, as the ``migrate`` one-shot does: a model uploaded through one replica trains a
job submitted to the other, a device enrolled on the second takes its task there, and the finished model
is read through both. Without blobs in the database, or with secrets that differ, this fails."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from fedlink.server.app import Coordinator
from fedlink.server.settings import CoordinatorSettings, load_settings
from fedlink.server.store.migrate import upgrade
from fedlink.server.tls import load_channel_credentials
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import COORDINATORS, service_environment
from .test_dashboard import _e2e_helpers

pytestmark = pytest.mark.postgres


def _replica_settings(
    compose: dict[str, Any], name: str, secrets_dir: Path, deploy_dir: Path, db_url: str, data_dir: Path
) -> CoordinatorSettings:
    environment = service_environment(compose, name, secrets_dir, deploy_dir)
    environment |= {
        "FEDLINK_DATA_DIR": str(data_dir),  # the service's own volume at the image's /var/lib/fedlink
        "FEDLINK_DB_URL": db_url,  # what the entrypoint builds from the password secret
        "FEDLINK_LISTEN_ADDRESS": "127.0.0.1:0",
        "FEDLINK_METRICS_ADDRESS": "127.0.0.1:0",
    }
    return load_settings(environ=environment)


@contextlib.asynccontextmanager
async def _channel(coordinator: Coordinator, ca: Path) -> AsyncIterator[grpc.aio.Channel]:
    assert coordinator.endpoint is not None and not coordinator.endpoint.insecure
    # 127.0.0.1, as a HEALTHCHECK and the host's published ports reach it: the certificate names it.
    address = f"127.0.0.1:{coordinator.endpoint.port}"
    async with grpc.aio.secure_channel(address, load_channel_credentials(ca)) as channel:
        yield channel


async def test_compose_replicas_share_one_database_its_blobs_and_their_secrets(
    compose: dict[str, Any],
    deploy_dir: Path,
    secrets_dir: Path,
    repo_root: Path,
    tmp_path: Path,
    pg_database: str,
) -> None:
    first, second = COORDINATORS
    await upgrade(pg_database)  # the migrate service: `fedlink db upgrade`; serve does not migrate
    settings = {
        name: _replica_settings(compose, name, secrets_dir, deploy_dir, pg_database, tmp_path / name)
        for name in (first, second)
    }
    assert all(s.blobs_in_database and s.auto_migrate is False for s in settings.values())
    helpers = _e2e_helpers(repo_root)
    ca = secrets_dir / "ca.pem"
    join_secret = (secrets_dir / "join-secret").read_text().strip()
    admin = (("authorization", f"Bearer {(secrets_dir / 'admin-token').read_text().strip()}"),)
    async with (
        Coordinator(settings[first]) as a,
        Coordinator(settings[second]) as b,
        _channel(a, ca) as channel_a,
        _channel(b, ca) as channel_b,
    ):
        control_a: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel_a)
        control_b: cgrpc.ControlServiceAsyncStub = cgrpc.ControlServiceStub(channel_b)
        device = await helpers.StubDevice(channel_b).enroll(join_secret=join_secret)
        await device.get_job()  # only devices that asked for work are sampled
        # Uploaded through the second replica, used by the job the first one is given: whichever drives
        # it, one replica reads bytes the other stored (the initial model, or the final one below).
        start = helpers.weights_dxo({"w": np.zeros(3, np.float32)})
        sha = await helpers.upload_model(control_b, start, admin)
        spec = cpb.JobSpec(name="replicas", initial_model=dxo_pb2.BlobRef(sha256=sha))
        spec.fedavg.num_rounds = 1
        job_id = (await control_a.SubmitJob(cpb.SubmitJobRequest(spec=spec), metadata=admin)).job.job_id
        async with asyncio.timeout(60):  # a long poll ends in RETRY after the server's max_task_wait
            while (task := await device.get_task(job_id, wait_s=20)).status == rpb.RUNNER_STATUS_RETRY:
                pass
        assert task.status == rpb.RUNNER_STATUS_OK, task
        diff = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
        diff.data["w"].CopyFrom(helpers.dense(np.ones(3, np.float32)))
        diff.meta["num_examples"].int_value = 3
        assert (await device.report(job_id, task, diff)).status == rpb.RUNNER_STATUS_OK
        watch = control_a.WatchJob(cpb.WatchJobRequest(job_id=job_id), metadata=admin, timeout=60)
        events = [event async for event in watch]
        models = await asyncio.gather(
            helpers.download_model(control_a, job_id, admin), helpers.download_model(control_b, job_id, admin)
        )
    assert events[-1].state == states_pb2.JOB_STATE_FINISHED, events[-1]
    for model in models:
        np.testing.assert_array_equal(helpers.read_tensor(model.data["w"]), np.ones(3, np.float32))
    # Each replica its own data directory (its coordinator id and lock), and no blob in either.
    ids = {(tmp_path / name / "coordinator-id").read_text() for name in (first, second)}
    assert len(ids) == 2
    assert not [p for name in (first, second) for p in (tmp_path / name).rglob("*") if "blobs" in p.parts]
