"""Fixtures for the Runner tests: an in-process coordinator on 127.0.0.1:0 and job submission."""

from __future__ import annotations

import contextlib
import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from sklearn.datasets import load_digits

from fedlink.common.dxo import DXO, DataKind
from fedlink.runner.transport.backoff import Backoff
from fedlink.runner.transport.grpc_transport import GrpcTransport, GrpcTransportConfig
from fedlink.server.app import Coordinator
from fedlink.server.settings import CoordinatorSettings
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2

Metadata = tuple[tuple[str, str], ...]


@dataclass
class Control:
    """The operator's side of a running coordinator, through the generated stubs."""

    coordinator: Coordinator
    stub: cgrpc.ControlServiceAsyncStub
    metadata: Metadata

    @property
    def address(self) -> str:
        assert self.coordinator.endpoint is not None
        return self.coordinator.endpoint.address

    async def submit(
        self,
        initial: dict[str, np.ndarray],
        job_data: dict[str, Any] | str,
        *,
        rounds: int = 1,
        devices: int = 0,
        name: str = "job",
        round_timeout_s: int = 60,
    ) -> str:
        data = DXO(kind=DataKind.WEIGHTS, data=initial).to_bytes()
        sha = hashlib.sha256(data).hexdigest()

        def parts() -> Iterator[cpb.UploadModelRequest]:
            yield cpb.UploadModelRequest(
                header=dxo_pb2.BlobUploadHeader(sha256=sha, size_bytes=len(data), offset=0)
            )
            for start in range(0, len(data), 1024 * 1024):
                yield cpb.UploadModelRequest(chunk=data[start : start + 1024 * 1024])

        await self.stub.UploadModel(parts(), metadata=self.metadata)
        spec = cpb.JobSpec(
            name=name,
            initial_model=dxo_pb2.BlobRef(sha256=sha),
            job_data=job_data if isinstance(job_data, str) else json.dumps(job_data),
        )
        spec.fedavg.num_rounds = rounds
        spec.fedavg.seed = 1
        spec.fedavg.round_timeout.FromSeconds(round_timeout_s)
        if devices:
            spec.fedavg.devices_per_round = devices
            spec.fedavg.min_results = devices
        reply = await self.stub.SubmitJob(
            cpb.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4())), metadata=self.metadata
        )
        return str(reply.job.job_id)

    async def describe(self, job_id: str) -> cpb.Job:
        reply = await self.stub.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=self.metadata)
        return reply.job

    async def model(self, job_id: str, round: int = 0) -> DXO:
        stream = self.stub.DownloadModel(
            cpb.DownloadModelRequest(job_id=job_id, round=round), metadata=self.metadata
        )
        return DXO.from_bytes(b"".join([c.data async for c in stream]))


#: The component types the tests' Runners register in their app registries: the coordinator accepts
#: them in job_data (its component_types setting), as it does the built-ins and import paths.
APP_TYPES = ("Exploding", "ReturnsNumber", "Garbage", "JobIn", "JobOut", "Log", "Slow")


def coordinator_settings(data_dir: Path, **overrides: Any) -> CoordinatorSettings:
    overrides.setdefault("component_types", APP_TYPES)
    return CoordinatorSettings(
        data_dir=data_dir,
        listen_address="127.0.0.1:0",
        insecure=True,
        open_enrolment=True,
        **overrides,
    )


@contextlib.asynccontextmanager
async def serving(settings: CoordinatorSettings) -> AsyncIterator[Control]:
    """A coordinator with ``settings``, and the operator's side of it."""
    async with Coordinator(settings) as coordinator:
        assert coordinator.endpoint is not None
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            yield Control(
                coordinator,
                cgrpc.ControlServiceStub(channel),
                (("authorization", f"Bearer {coordinator.admin_token}"),),
            )


@pytest.fixture
async def control(tmp_path: Path) -> AsyncIterator[Control]:
    async with serving(coordinator_settings(tmp_path / "coordinator")) as control:
        yield control


def transport(address: str, state_dir: Path, **overrides: Any) -> GrpcTransport:
    """A plaintext transport with short waits, as the tests want them."""
    settings: dict[str, Any] = {
        "task_wait": timedelta(seconds=1),
        "per_request": timedelta(seconds=5),
        "backoff": Backoff(base=timedelta(milliseconds=50), cap=timedelta(milliseconds=500)),
    }
    settings.update(overrides)
    return GrpcTransport(GrpcTransportConfig(server=address, state_dir=state_dir, insecure=True, **settings))


def digits_npz(directory: Path, partitions: int, *, seed: int = 0) -> list[Path]:
    """The digits split IID into ``partitions`` .npz files with train/valid arrays."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(y))
    paths = []
    for i, part in enumerate(np.array_split(order, partitions)):
        cut = int(len(part) * 0.8)
        path = directory / f"part{i}.npz"
        np.savez(
            path, x_train=x[part[:cut]], y_train=y[part[:cut]], x_valid=x[part[cut:]], y_valid=y[part[cut:]]
        )
        paths.append(path)
    return paths


def softmax_job(*, epochs: int = 1, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    trainer = {"epochs": epochs, "batch_size": 32, "learning_rate": 0.5}
    trainer.update(extra or {})
    return {
        "components": [{"type": "SoftmaxRegressionTrainer", "name": "trainer", "args": trainer}],
        "executors": {"*": "@trainer"},
    }


def zero_softmax_model(features: int = 64, classes: int = 10) -> dict[str, np.ndarray]:
    return {
        "weight": np.zeros((features, classes), np.float32),
        "bias": np.zeros((classes,), np.float32),
    }
