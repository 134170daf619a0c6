"""`fedlink serve` as its own process: a FedAvg job driven by stub-only devices is bit-exact, a
coordinator SIGKILLed in the middle of a round resumes it with every acknowledged result counted once
(and FedAdam's moments with it), and a coordinator whose job supervisor cannot recover says so and exits.
"""

from __future__ import annotations

import hashlib
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.orphans import tied
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb
from fedlink.v1 import runner_service_pb2_grpc as rgrpc

from .conftest import dense, read_tensor, weights_dxo

pytestmark = pytest.mark.slow

SHAPES = {"w": (4, 3), "b": (3,)}
#: How long to wait for a coordinator process or a job to get somewhere: seconds on a quiet machine;
#: far beyond that, so that a loaded machine is no failure, and a hang still is one.
PROCESS_WAIT_S = 180.0


class Serve:
    """A `fedlink serve` process on a data directory (and optionally another database).

    Its output (standard output and error) is read all along by a thread, so the process never blocks
    on a full pipe, and the test can wait for its address with a deadline that holds.
    """

    def __init__(self, data_dir: Path, db_url: str | None) -> None:
        self.data_dir = data_dir
        self.db_url = db_url
        self.process: subprocess.Popen[str] | None = None
        self.address = ""
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._output: list[str] = []
        self._reader: threading.Thread | None = None

    def migrate(self) -> None:
        """`fedlink db upgrade`, as an operator does before the first start on PostgreSQL."""
        if self.db_url:
            fedlink = str(Path(sys.executable).parent / "fedlink")
            subprocess.run(
                tied([fedlink, "db", "upgrade", "--db", self.db_url]),
                check=True,
                capture_output=True,
                timeout=PROCESS_WAIT_S,
            )

    def start(self, *extra: str) -> None:
        """Starts the process and waits until it listens."""
        self.launch(*extra)
        self.wait_listening()

    def launch(self, *extra: str) -> None:
        """Starts the process without waiting for it (call :meth:`wait_listening` later). From the
        thread that owns the test: the process is tied to the thread that starts it."""
        fedlink = str(Path(sys.executable).parent / "fedlink")
        args = [fedlink, "serve", "--data-dir", str(self.data_dir), "--listen-address", "127.0.0.1:0"]
        args += ["--insecure", "--open-enrolment", "--reaper-interval", "200ms", *extra]
        if self.db_url:
            args += ["--db-url", self.db_url]
        process = subprocess.Popen(tied(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.process, self._lines, self._output, self.address = process, queue.Queue(), [], ""
        self._reader = threading.Thread(target=self._read, args=(process, self._lines), daemon=True)
        self._reader.start()

    def wait_listening(self) -> None:
        """Waits until the process started by :meth:`launch` says where it listens."""
        process = self.process
        assert process is not None
        if self.address:
            return
        deadline = time.monotonic() + PROCESS_WAIT_S
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                message = f"fedlink serve did not report its address within {PROCESS_WAIT_S:g} s"
                raise AssertionError(f"{message}:\n{self.output()}") from None
            if line is None:
                raise AssertionError(f"fedlink serve exited with {process.wait()}:\n{self.output()}")
            self._output.append(line)
            if " listening on " in line:
                self.address = line.split(" listening on ", 1)[1].split()[0]
                return

    @staticmethod
    def _read(process: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert process.stdout is not None
        with process.stdout:
            for line in process.stdout:
                lines.put(line)
        lines.put(None)  # end of output: the process has exited (or closed it)

    def output(self) -> str:
        """What the process printed so far (all of it, once it has exited)."""
        if self.process is not None and self.process.poll() is not None and self._reader is not None:
            self._reader.join(timeout=PROCESS_WAIT_S)
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                return "".join(self._output)
            if line is not None:
                self._output.append(line)

    def wait(self) -> int:
        """Waits for the process to exit on its own; its exit status."""
        assert self.process is not None
        code = self.process.wait(timeout=PROCESS_WAIT_S)
        if self._reader is not None:
            self._reader.join(timeout=PROCESS_WAIT_S)
        return code

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.wait()

    def stop(self) -> int:
        if self.process is None:
            return 0
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.wait()

    @property
    def admin(self) -> tuple[tuple[str, str], ...]:
        token = (self.data_dir / "admin-token").read_text().strip()
        return (("authorization", f"Bearer {token}"),)


class Device:
    """A device written against the generated stubs only, as a client in another language would."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.request_id = str(uuid.uuid4())
        self.credential = ""
        self.device_id = ""
        self.tasks: list[str] = []

    def stub(self, address: str) -> rgrpc.RunnerServiceStub:
        return rgrpc.RunnerServiceStub(grpc.insecure_channel(address))

    @property
    def meta(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.credential}"),)

    def enroll(self, address: str) -> None:
        reply = self.stub(address).Enroll(
            rpb.EnrollRequest(
                protocol_version="1.0", request_id=self.request_id, device_info={"i": str(self.index)}
            )
        )
        self.device_id, self.credential = reply.device_id, reply.device_credential
        # A device is sampled only once it has asked for work (GetJob), as every runner does first.
        self.stub(address).GetJob(rpb.GetJobRequest(protocol_version="1.0"), metadata=self.meta)

    def next_task(self, address: str, job_id: str, wait_s: float = PROCESS_WAIT_S) -> rpb.GetTaskResponse:
        stub = self.stub(address)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            request = rpb.GetTaskRequest(job_id=job_id)
            request.wait_timeout.FromSeconds(2)
            task = stub.GetTask(request, metadata=self.meta)
            if task.status == rpb.RUNNER_STATUS_OK:
                self.tasks.append(task.task_id)
                return task
            if task.status == rpb.RUNNER_STATUS_DONE:
                return task
        raise AssertionError(f"device {self.index} got no task within {wait_s} s")

    def report(
        self, address: str, job_id: str, task: rpb.GetTaskResponse, round_no: int, request_id: str
    ) -> rpb.ReportResultResponse:
        diff = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
        for name, shape in SHAPES.items():
            diff.data[name].CopyFrom(dense(update(self.index, round_no, shape)))
        diff.meta["num_examples"].int_value = 5 * (self.index + 1)
        request = rpb.ReportResultRequest(
            job_id=job_id,
            task_id=task.task_id,
            cookie=task.cookie,
            status=states_pb2.RESULT_STATUS_SUCCEEDED,
            request_id=request_id,
        )
        request.result.dxo.CopyFrom(diff)
        reply: rpb.ReportResultResponse = self.stub(address).ReportResult(request, metadata=self.meta)
        return reply


def update(index: int, round_no: int, shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng([index, round_no]).normal(size=shape).astype(np.float32)


def expected_model(
    initial: dict[str, np.ndarray], devices: list[Device], rounds: int
) -> dict[str, np.ndarray]:
    """FedAvg as the coordinator must compute it: float64 weighted sums in device-id order."""
    model = {k: v.copy() for k, v in initial.items()}
    for round_no in range(1, rounds + 1):
        for name, value in model.items():
            total = np.zeros(value.shape, np.float64)
            weight = 0.0
            for device in sorted(devices, key=lambda d: d.device_id):
                w = 5 * (device.index + 1)
                total += update(device.index, round_no, value.shape).astype(np.float64) * np.float64(w)
                weight += w
            model[name] = (value.astype(np.float64) + total / weight).astype(np.float32)
    return model


def submit(
    serve: Serve,
    initial: dict[str, np.ndarray],
    rounds: int,
    *,
    fedadam: bool = False,
    request_id: str = "submit-1",
    devices: int = 0,
) -> str:
    """Submits a job of ``rounds`` rounds; with ``devices``, each round waits for that many devices
    and their results (without, a round starts with the devices enrolled by then)."""
    control = cgrpc.ControlServiceStub(grpc.insecure_channel(serve.address))
    data = weights_dxo(initial).SerializeToString(deterministic=True)
    sha = hashlib.sha256(data).hexdigest()
    header = dxo_pb2.BlobUploadHeader(sha256=sha, size_bytes=len(data))
    parts = iter([cpb.UploadModelRequest(header=header), cpb.UploadModelRequest(chunk=data)])
    control.UploadModel(parts, metadata=serve.admin)
    spec = cpb.JobSpec(name="kill-test", initial_model=dxo_pb2.BlobRef(sha256=sha))
    rounds_config = spec.fedadam.rounds if fedadam else spec.fedavg
    rounds_config.num_rounds = rounds
    rounds_config.round_timeout.FromSeconds(600)  # rounds close on their results; a bound, not a wait
    rounds_config.devices_per_round = rounds_config.min_results = devices
    if fedadam:
        spec.fedadam.server_learning_rate = 0.3
    job: str = control.SubmitJob(
        cpb.SubmitJobRequest(spec=spec, request_id=request_id), metadata=serve.admin
    ).job.job_id
    return job


def final_model(serve: Serve, job_id: str) -> tuple[int, dict[str, np.ndarray]]:
    control = cgrpc.ControlServiceStub(grpc.insecure_channel(serve.address))
    deadline = time.monotonic() + PROCESS_WAIT_S
    job = control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=serve.admin).job
    while (
        job.state in (states_pb2.JOB_STATE_PENDING, states_pb2.JOB_STATE_RUNNING)
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
        job = control.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=serve.admin).job
    chunks = control.DownloadModel(cpb.DownloadModelRequest(job_id=job_id), metadata=serve.admin)
    model = dxo_pb2.Dxo.FromString(b"".join(c.data for c in chunks))
    return job.state, {name: read_tensor(t) for name, t in model.data.items()}


@pytest.fixture(params=["sqlite", "postgres"])
def serve(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Serve]:
    db_url = request.getfixturevalue("pg_database") if request.param == "postgres" else None
    process = Serve(tmp_path / "data", db_url)
    try:
        yield process
    finally:
        if process.process is not None and process.process.poll() is None:
            process.process.kill()
        process.stop()


def test_sigkill_mid_round_counts_every_acknowledged_result_once(serve: Serve) -> None:
    initial = {
        name: np.arange(np.prod(shape), dtype=np.float32).reshape(shape) for name, shape in SHAPES.items()
    }
    serve.migrate()
    serve.start()
    devices = [Device(i) for i in range(3)]
    for device in devices:
        device.enroll(serve.address)
    job_id = submit(serve, initial, rounds=2)

    # Round 1: two devices report and are acknowledged; the third holds its task when the coordinator dies.
    tasks = {d.index: d.next_task(serve.address, job_id) for d in devices}
    acked: dict[int, str] = {}
    for device in devices[:2]:
        request_id = f"r1-{device.index}"
        assert (
            device.report(serve.address, job_id, tasks[device.index], 1, request_id).status
            == rpb.RUNNER_STATUS_OK
        )
        acked[device.index] = request_id
    serve.kill()

    serve.start()  # same data directory and database
    # A device whose acknowledgement it never saw retries with the same request id: the original OK.
    retry = devices[0].report(serve.address, job_id, tasks[0], 1, acked[0])
    assert retry.status == rpb.RUNNER_STATUS_OK
    # The third device finishes its round-1 task after the restart (its lease and cookie survived).
    assert devices[2].report(serve.address, job_id, tasks[2], 1, "r1-2").status == rpb.RUNNER_STATUS_OK

    # Round 2: everyone gets a new task; nobody is asked to redo round 1.
    for device in devices:
        task = device.next_task(serve.address, job_id)
        assert task.status == rpb.RUNNER_STATUS_OK
        assert task.task_id != tasks[device.index].task_id
        assert (
            device.report(serve.address, job_id, task, 2, f"r2-{device.index}").status == rpb.RUNNER_STATUS_OK
        )

    state, model = final_model(serve, job_id)
    assert state == states_pb2.JOB_STATE_FINISHED
    expected = expected_model(initial, devices, rounds=2)
    for name, value in expected.items():
        assert model[name].tobytes() == value.tobytes(), f"{name} differs: a result was lost or counted twice"
    for device in devices:
        assert len(device.tasks) == 2 and len(set(device.tasks)) == 2
        assert device.next_task(serve.address, job_id).status == rpb.RUNNER_STATUS_DONE
    assert serve.stop() == 0


def _round(serve: Serve, devices: list[Device], job_id: str, round_no: int, tag: str) -> None:
    for device in devices:
        task = device.next_task(serve.address, job_id)
        assert task.status == rpb.RUNNER_STATUS_OK
        reply = device.report(serve.address, job_id, task, round_no, f"{tag}-r{round_no}-{device.index}")
        assert reply.status == rpb.RUNNER_STATUS_OK


def test_fedadam_killed_mid_run_resumes_its_moments_bit_identically(serve: Serve) -> None:
    """FedAdam's moments are checkpointed with the model: a coordinator SIGKILLed in round 2 and
    restarted ends with the model an uninterrupted run of the same job makes, to the bit."""
    initial = {name: np.full(shape, 0.5, np.float32) for name, shape in SHAPES.items()}
    serve.migrate()
    serve.start()
    devices = [Device(i) for i in range(3)]
    for device in devices:
        device.enroll(serve.address)

    killed = submit(serve, initial, rounds=3, fedadam=True, request_id="killed")
    _round(serve, devices, killed, 1, "killed")  # round 1 closes: a checkpoint with m and v
    tasks = {d.index: d.next_task(serve.address, killed) for d in devices}
    for device in devices[:2]:
        reply = device.report(serve.address, killed, tasks[device.index], 2, f"killed-r2-{device.index}")
        assert reply.status == rpb.RUNNER_STATUS_OK
    serve.kill()
    serve.start()
    reply = devices[2].report(serve.address, killed, tasks[2], 2, "killed-r2-2")
    assert reply.status == rpb.RUNNER_STATUS_OK
    _round(serve, devices, killed, 3, "killed")
    state, resumed = final_model(serve, killed)
    assert state == states_pb2.JOB_STATE_FINISHED

    # The same job again, on the same devices (the same canonical order), never interrupted.
    whole = submit(serve, initial, rounds=3, fedadam=True, request_id="whole")
    for round_no in (1, 2, 3):
        _round(serve, devices, whole, round_no, "whole")
    state, uninterrupted = final_model(serve, whole)
    assert state == states_pb2.JOB_STATE_FINISHED
    for name, value in uninterrupted.items():
        assert resumed[name].tobytes() == value.tobytes(), f"{name}: the resumed run's moments differed"
    # The moments matter: FedAdam's model is not FedAvg's.
    fedavg = expected_model(initial, devices, rounds=3)
    assert any(resumed[name].tobytes() != fedavg[name].tobytes() for name in fedavg)
    assert serve.stop() == 0


def test_serve_exits_3_with_health_not_serving_when_a_loop_cannot_recover(tmp_path: Path) -> None:
    serve = Serve(tmp_path / "data", None)
    serve.start("--loop-failure-timeout", "1s", "--shutdown-grace", "1s")
    try:
        with grpc.insecure_channel(serve.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert (
                health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
            )
            watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=PROCESS_WAIT_S)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            # The job supervisor's table disappears for good (a botched manual migration).
            with sqlite3.connect(serve.data_dir / "fedlink.db", timeout=60) as db:
                db.execute("ALTER TABLE jobs RENAME TO jobs_away")
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        code = serve.wait()
        output = serve.output()
        assert code == 3, output
        assert "background loop 'job-supervisor' failed" in output
        assert "no such table: jobs" in output
    finally:
        if serve.process is not None and serve.process.poll() is None:
            serve.process.kill()
        serve.stop()
