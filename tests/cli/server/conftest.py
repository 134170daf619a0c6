"""Fixtures for the operator CLI tests: a real coordinator on its own loop, the CLI, stub-only devices.

The CLI is synchronous (it blocks in gRPC calls), so the coordinator runs on an event loop in a
background thread; tests are plain functions that invoke the CLI in-process with click's runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Coroutine, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
import pytest
from click.testing import CliRunner, Result

from fedlink.cli.main import build_cli
from fedlink.server.app import Coordinator
from fedlink.server.settings import CoordinatorSettings
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb
from fedlink.v1 import runner_service_pb2_grpc as rgrpc

T = TypeVar("T")


class CoordinatorThread:
    """A real :class:`Coordinator` served from an event loop in a background thread."""

    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="coordinator", daemon=True)
        self.coordinator: Coordinator | None = None

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Runs a coroutine on the coordinator's loop."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def __enter__(self) -> CoordinatorThread:
        self._thread.start()

        async def start() -> Coordinator:
            coordinator = Coordinator(self.settings)
            await coordinator.start()
            return coordinator

        self.coordinator = self.submit(start()).result(timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.coordinator is not None:
            self.submit(self.coordinator.stop(grace=0)).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()

    @property
    def address(self) -> str:
        """Where the coordinator listens."""
        assert self.coordinator is not None and self.coordinator.endpoint is not None
        return self.coordinator.endpoint.address

    @property
    def admin_token(self) -> str:
        """The operator credential."""
        assert self.coordinator is not None
        return self.coordinator.admin_token


@dataclass
class Cli:
    """Invokes ``fedlink`` in-process with a fixed environment (no developer settings leak in)."""

    env: dict[str, str] = field(default_factory=dict)

    def __call__(self, *args: str, env: Mapping[str, str] | None = None) -> Result:
        environment: dict[str, str | None] = {
            name: None
            for name in (
                "FEDLINK_SERVER",
                "FEDLINK_INSECURE",
                "FEDLINK_ADMIN_TOKEN",
                "FEDLINK_ADMIN_TOKEN_FILE",
                "FEDLINK_DATA_DIR",
                "FEDLINK_CONFIG",
            )
        }
        environment.update(self.env)
        environment.update(env or {})
        return CliRunner().invoke(
            build_cli(server_extra=True), list(args), env=environment, prog_name="fedlink"
        )


def plaintext_settings(data_dir: Path) -> CoordinatorSettings:
    """A plaintext coordinator with open enrolment on 127.0.0.1:0 and a fast maintenance sweep."""
    return CoordinatorSettings(
        data_dir=data_dir,
        listen_address="127.0.0.1:0",
        insecure=True,
        open_enrolment=True,
        reaper_interval=timedelta(seconds=0.2),
    )


def cli_for(coordinator: CoordinatorThread) -> Cli:
    """The CLI pointed at a running coordinator through the environment."""
    return Cli(
        env={
            "FEDLINK_SERVER": coordinator.address,
            "FEDLINK_INSECURE": "1",
            "FEDLINK_ADMIN_TOKEN": coordinator.admin_token,
            "FEDLINK_DATA_DIR": str(coordinator.settings.data_dir),
        }
    )


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[CoordinatorThread]:
    """A fresh plaintext coordinator for one test."""
    with CoordinatorThread(plaintext_settings(tmp_path / "data")) as running:
        yield running


@pytest.fixture
def cli(coordinator: CoordinatorThread) -> Cli:
    """The CLI pointed at the ``coordinator`` fixture."""
    return cli_for(coordinator)


# ---- devices written against the generated stubs only ------------------------------------------------


def dense(array: np.ndarray) -> dxo_pb2.Tensor:
    """A dense little-endian wire tensor."""
    a = np.ascontiguousarray(array)
    return dxo_pb2.Tensor(
        dtype=a.dtype.name,
        shape=list(a.shape),
        dense=dxo_pb2.DenseEncoding(data=a.astype(a.dtype.newbyteorder("<")).tobytes()),
    )


def read_tensor(tensor: dxo_pb2.Tensor) -> np.ndarray:
    """A dense wire tensor as an array."""
    return np.frombuffer(tensor.dense.data, dtype=np.dtype(tensor.dtype).newbyteorder("<")).reshape(
        tuple(tensor.shape)
    )


class StubDevice:
    """A device speaking RunnerService through the generated async stubs."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub: rgrpc.RunnerServiceAsyncStub = rgrpc.RunnerServiceStub(channel)
        self.device_id = ""
        self.metadata: tuple[tuple[str, str], ...] = ()

    async def enroll(self, info: dict[str, str] | None = None) -> StubDevice:
        reply = await self.stub.Enroll(
            rpb.EnrollRequest(
                device_info=info or {"platform": "test"}, protocol_version="1.0", request_id=str(uuid.uuid4())
            )
        )
        self.device_id = reply.device_id
        self.metadata = (("authorization", f"Bearer {reply.device_credential}"),)
        return self

    async def get_job(self) -> rpb.GetJobResponse:
        return await self.stub.GetJob(rpb.GetJobRequest(protocol_version="1.0"), metadata=self.metadata)

    async def train(self, delta: float, *, error: str | None = None, loss: float | None = None) -> int:
        """Takes the job and answers each task with a WEIGHT_DIFF of ``delta`` (or, given ``error``, a
        FAILED report with that message); returns the tasks done. Given ``loss``, each result reports
        ``train_loss`` = ``loss`` / the task's number (so the rounds' metrics fall)."""
        job = await self.get_job()
        while job.status != rpb.RUNNER_STATUS_OK:
            await asyncio.sleep(0.05)
            job = await self.get_job()
        cookie = b""
        done = 0
        while True:
            request = rpb.GetTaskRequest(job_id=job.job_id, cookie=cookie)
            request.wait_timeout.FromMilliseconds(2000)
            task = await self.stub.GetTask(request, metadata=self.metadata)
            if task.status == rpb.RUNNER_STATUS_DONE:
                return done
            if task.status != rpb.RUNNER_STATUS_OK:
                continue
            diff = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
            for name, tensor in task.task_data.dxo.data.items():
                value = read_tensor(tensor)
                diff.data[name].CopyFrom(dense(np.full(value.shape, delta, value.dtype)))
            diff.meta["num_examples"].int_value = 1
            if loss is not None:
                diff.meta["train_loss"].double_value = loss / (done + 1)
            report = rpb.ReportResultRequest(
                job_id=job.job_id,
                task_id=task.task_id,
                cookie=task.cookie,
                status=states_pb2.RESULT_STATUS_SUCCEEDED
                if error is None
                else states_pb2.RESULT_STATUS_FAILED,
                request_id=str(uuid.uuid4()),
                error_message=error or "",
            )
            if error is None:
                report.result.dxo.CopyFrom(diff)
            reply = await self.stub.ReportResult(report, metadata=self.metadata)
            assert reply.status == rpb.RUNNER_STATUS_OK, reply
            cookie = reply.cookie
            done += 1


# ---- the outside world: a network that drops a connection ---------------------------------------------


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 whose first connection is cut after ``cut_after`` bytes from the client.

    It stands in for a network that drops a long upload; later connections are forwarded untouched.
    """

    def __init__(self, target: str, *, cut_after: int) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._cut_after = cut_after
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.connections = 0
        self.cuts = 0
        self._sockets: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self._target)
            with self._lock:
                self.connections += 1
                limit = self._cut_after if self.connections == 1 else None
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, limit), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, None), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, limit: int | None) -> None:
        forwarded = 0
        try:
            while data := source.recv(65536):
                if limit is not None and forwarded + len(data) > limit:
                    # Hold the cut a moment, as a stalled link would, so the coordinator has stored
                    # what reached it; then drop the connection mid-stream.
                    time.sleep(1.0)
                    with self._lock:
                        self.cuts += 1
                    break
                sink.sendall(data)
                forwarded += len(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Closes the listener and every forwarded connection."""
        with self._lock:
            for sock in self._sockets:
                sock.close()
