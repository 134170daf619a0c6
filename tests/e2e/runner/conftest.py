"""Process tests of ``fedlink runner``: an in-process coordinator, a TCP proxy, runner subprocesses."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from sklearn.datasets import load_digits

from bench.orphans import tied
from fedlink.common.dxo import DXO, DataKind
from fedlink.common.errors import NotFound
from fedlink.server.app import Coordinator
from fedlink.server.domain import Assignment, Result
from fedlink.server.settings import CoordinatorSettings
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2

FEDLINK = str(Path(sys.executable).parent / "fedlink")
#: How long a test waits for a runner process to get somewhere (start, enrol, train, exit): seconds on a
#: quiet machine; far beyond that, so that a loaded machine is no failure, and a hang still is one.
PROCESS_WAIT_S = 180.0


class Proxy:
    """A TCP proxy in front of the coordinator that counts connections and can cut the link.

    ``mode``: ``"forward"`` relays bytes; ``"blackhole"`` keeps connections open but drops every byte
    (a call hangs as over a dead network); ``"refuse"`` closes every new connection at once (the
    coordinator is down).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.mode = "forward"
        self.accepted = 0
        self.accept_times: list[float] = []
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        """Closes every open connection (the peers see a reset)."""
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.accept_times.append(asyncio.get_running_loop().time())
        if self.mode == "refuse":
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update({writer, up_writer})
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if self.mode == "forward":
                    writer.write(data)
                    await writer.drain()
        self._writers.discard(writer)
        writer.transport.abort()


@dataclass
class Harness:
    """A running coordinator with a proxy in front, and helpers to drive it."""

    coordinator: Coordinator
    control: cgrpc.ControlServiceAsyncStub
    metadata: tuple[tuple[str, str], ...]
    proxy: Proxy
    tmp: Path
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def address(self) -> str:
        assert self.coordinator.endpoint is not None
        return self.coordinator.endpoint.address

    async def submit(
        self, job_data: dict[str, Any], *, rounds: int = 1, devices: int = 1, name: str = "job"
    ) -> str:
        initial = DXO(
            kind=DataKind.WEIGHTS,
            data={"weight": np.zeros((64, 10), np.float32), "bias": np.zeros((10,), np.float32)},
        )
        data = initial.to_bytes()
        sha = hashlib.sha256(data).hexdigest()

        def parts() -> Iterator[cpb.UploadModelRequest]:
            yield cpb.UploadModelRequest(header=dxo_pb2.BlobUploadHeader(sha256=sha, size_bytes=len(data)))
            yield cpb.UploadModelRequest(chunk=data)

        await self.control.UploadModel(parts(), metadata=self.metadata)
        spec = cpb.JobSpec(
            name=name, job_data=json.dumps(job_data), initial_model=dxo_pb2.BlobRef(sha256=sha)
        )
        spec.fedavg.num_rounds = rounds
        spec.fedavg.devices_per_round = devices
        spec.fedavg.min_results = devices
        spec.fedavg.round_timeout.FromSeconds(600)  # rounds close on their results; a bound, not a wait
        reply = await self.control.SubmitJob(
            cpb.SubmitJobRequest(spec=spec, request_id=str(uuid.uuid4())), metadata=self.metadata
        )
        return str(reply.job.job_id)

    async def job_state(self, job_id: str) -> int:
        reply = await self.control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=self.metadata)
        return int(reply.job.state)

    async def assignments(self, job_id: str) -> list[Assignment]:
        store = self.coordinator.store
        assert store is not None
        try:
            run = await store.get_current_run(job_id)
        except NotFound:  # the supervisor has not started the job yet
            return []
        tasks = await store.list_tasks(run.run_id)
        return list(await store.list_assignments(task_ids=[t.task_id for t in tasks]))

    async def results(self, job_id: str) -> list[Result]:
        store = self.coordinator.store
        assert store is not None
        run = await store.get_current_run(job_id)
        return list(await store.list_results(run_id=run.run_id, accepted_only=False))

    async def wait_for(self, what: str, predicate: Any, within: float = PROCESS_WAIT_S) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while not await predicate():
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what} ({within:g} s)")
            await asyncio.sleep(0.02)

    def runner(self, name: str, data: Path, *extra: str, via_proxy: bool = True) -> subprocess.Popen[bytes]:
        """Starts ``fedlink runner`` (output in ``<tmp>/<name>.log``)."""
        server = self.proxy.address if via_proxy else self.address
        command = [
            FEDLINK, "runner", "--server", server, "--insecure",
            "--state-dir", str(self.tmp / name), "--data", str(data),
            "--task-wait", "2s", "--per-request", "5s", *extra,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with (self.tmp / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(tied(command), stdout=log, stderr=subprocess.STDOUT, env=env)
        self.processes.append(process)
        return process

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text() if path.exists() else ""

    async def wait_for_log(self, name: str, text: str, within: float = PROCESS_WAIT_S) -> None:
        async def seen() -> bool:
            return text in self.log(name)

        await self.wait_for(f"{text!r} in {name}.log", seen, within)


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    settings = CoordinatorSettings(
        data_dir=tmp_path / "coordinator", listen_address="127.0.0.1:0", insecure=True, open_enrolment=True
    )
    async with Coordinator(settings) as coordinator:
        assert coordinator.endpoint is not None
        proxy = Proxy(coordinator.endpoint.port)
        await proxy.start()
        async with grpc.aio.insecure_channel(coordinator.endpoint.address) as channel:
            h = Harness(
                coordinator,
                cgrpc.ControlServiceStub(channel),
                (("authorization", f"Bearer {coordinator.admin_token}"),),
                proxy,
                tmp_path,
            )
            try:
                yield h
            finally:
                for process in h.processes:
                    if process.poll() is None:
                        process.send_signal(signal.SIGKILL)
                        process.wait()
                await proxy.close()


def digits_file(directory: Path, name: str = "digits.npz") -> Path:
    """All the digits as one .npz (x_train, y_train)."""
    x, y = load_digits(return_X_y=True)
    path = directory / name
    np.savez(path, x_train=(x / 16.0).astype(np.float32), y_train=y.astype(np.int64))
    return path


def slow_job(epochs: int) -> dict[str, Any]:
    """The softmax trainer with small batches for many epochs: a task that takes seconds."""
    args = {"epochs": epochs, "batch_size": 4, "learning_rate": 0.05}
    return {
        "components": [{"type": "SoftmaxRegressionTrainer", "name": "trainer", "args": args}],
        "executors": {"*": "@trainer"},
    }
