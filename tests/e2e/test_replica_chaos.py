"""Replicas of one PostgreSQL database under faults (issue 17): real `fedlink serve` processes, each on
a fixed port of its own (a restarted replica comes back where its clients know it), blob bytes in the
database, a 3 s run lease.

* Three replicas and three real `fedlink runner` processes that know all three addresses: the replica
  driving a 10-round FedAvg job is SIGKILLed five times, at random points, and restarted each time. The
  job finishes; every device's update of every round was accepted exactly once; the final model is
  bit-identical to the same job run again, uninterrupted, by the same devices. Each takeover (SIGKILL
  to another replica holding the run's lease) is timed and printed against its target, lease + 2 s.
* The driver SIGSTOPped past its lease: another replica takes the run over and closes the round; after
  SIGCONT the old driver's fenced writes are refused, nothing is aggregated twice (the model is the
  exact FedAvg of each device's update once per round), and it carries on serving as a plain replica.
* Every database connection of the driver terminated (``pg_terminate_backend``) after each report of a
  job: it reconnects by itself (its store and its LISTEN connection), and no acknowledged result is lost.
* A device revoked on one replica is refused on its very next call to another.

The devices of the last three are written against the generated stubs (as a client in another language
would be), so that the test says exactly when each report happens relative to the fault.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.orphans import tied
from fedlink.server.store.testing import asyncpg_dsn
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2, states_pb2
from fedlink.v1 import runner_service_pb2 as rpb

from .conftest import weights_dxo
from .runner.conftest import FEDLINK, digits_file
from .test_serve_process import (
    PROCESS_WAIT_S,
    SHAPES,
    Device,
    Serve,
    expected_model,
    final_model,
    submit,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

#: The run lease of every replica: a dead driver's run is another's this long after its last renewal.
LEASE_S = 3.0
#: The issue's target for a takeover after SIGKILL.
TAKEOVER_TARGET_S = LEASE_S + 2.0
ROUNDS = 10
KILLS = 5

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    """``count`` replicas of one database; replica ``i`` names its connections ``fedlink-replica-i``."""

    def __init__(self, tmp: Path, db_url: str, count: int) -> None:
        Serve(tmp / "migrate", db_url).migrate()
        self.db_url = db_url
        token = secrets.token_urlsafe(24)
        self.replicas: list[Serve] = []
        self.ports = [free_port() for _ in range(count)]
        for i in range(count):
            data_dir = tmp / f"replica-{i}"
            data_dir.mkdir(mode=0o700)
            # One operator token for every replica: the CLI and the test may talk to any of them.
            (data_dir / "admin-token").write_text(token)
            (data_dir / "admin-token").chmod(0o600)
            self.replicas.append(Serve(data_dir, f"{db_url}?application_name={self.application_name(i)}"))

    @staticmethod
    def application_name(i: int) -> str:
        return f"fedlink-replica-{i}"

    def start(self, i: int) -> None:
        """Starts replica ``i`` and waits until it listens."""
        self.launch(i)
        self.replicas[i].wait_listening()

    def launch(self, i: int) -> None:
        """Starts replica ``i`` without waiting for it (a start takes seconds)."""
        self.replicas[i].launch(
            "--listen-address", f"127.0.0.1:{self.ports[i]}",
            "--blobs-in-database", "--run-lease", f"{LEASE_S:g}s", "--no-auto-migrate",
        )  # fmt: skip

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    def owner(self, i: int) -> str:
        """Replica ``i``'s coordinator id (the owner of the runs it drives)."""
        return (self.replicas[i].data_dir / "coordinator-id").read_text().strip()

    def index_of(self, owner: str) -> int:
        for i in range(len(self.replicas)):
            if self.owner(i) == owner:
                return i
        raise AssertionError(f"no replica is coordinator {owner!r}")

    def close(self) -> None:
        for replica in self.replicas:
            if replica.process is not None and replica.process.poll() is None:
                replica.process.send_signal(signal.SIGCONT)  # a stopped one cannot act on SIGTERM
                replica.process.kill()
            replica.stop()

    def query(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        """Rows of ``sql``, read on a connection of the test's own."""

        async def fetch() -> list[asyncpg.Record]:
            conn = await asyncpg.connect(asyncpg_dsn(self.db_url), timeout=10)
            try:
                return list(await conn.fetch(sql, *args))
            finally:
                await conn.close()

        return asyncio.run(fetch())

    def run_of(self, job_id: str) -> asyncpg.Record | None:
        rows = self.query(
            "SELECT run_id, owner, lease_epoch, round, state FROM runs WHERE job_id = $1 "
            "ORDER BY created_at DESC LIMIT 1",
            job_id,
        )
        return rows[0] if rows else None

    def driver(self, job_id: str) -> int:
        """The index of the replica driving the job's run now (waits for one to take it)."""
        run = until(
            "a replica to drive the job",
            lambda: self.run_of(job_id),
            lambda r: r is not None and (bool(r["owner"]) or r["state"] != "RUNNING"),
        )
        assert run is not None and run["state"] == "RUNNING", (
            f"the job is no longer running: {dict(run or {})}"
        )
        return self.index_of(str(run["owner"]))

    def accepted_per_round(self, job_id: str) -> dict[int, list[str]]:
        """For each round, the devices whose accepted training result it has (one entry per result)."""
        rows = self.query(
            "SELECT t.round, r.device_id FROM results r JOIN tasks t ON t.task_id = r.task_id "
            "JOIN runs u ON u.run_id = t.run_id WHERE u.job_id = $1 AND t.name = 'train' AND r.accepted "
            "ORDER BY t.round, r.device_id",
            job_id,
        )
        rounds: dict[int, list[str]] = {}
        for row in rows:
            rounds.setdefault(int(row["round"]), []).append(str(row["device_id"]))
        return rounds


def until(what: str, read: Callable[[], T], ready: Callable[[T], bool], within: float = PROCESS_WAIT_S) -> T:
    """``read()`` again every 50 ms until ``ready`` says yes; fails naming ``what`` after ``within``."""
    deadline = time.monotonic() + within
    while True:
        value = read()
        if ready(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} ({within:g} s); last: {value!r}")
        time.sleep(0.05)


@pytest.fixture
def cluster_of(tmp_path: Path, pg_database: str) -> Iterator[Callable[[int], Cluster]]:
    made: list[Cluster] = []

    def make(count: int) -> Cluster:
        cluster = Cluster(tmp_path, pg_database, count)
        made.append(cluster)
        for i in range(count):
            cluster.start(i)
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.close()
            for i, replica in enumerate(cluster.replicas):  # shown by pytest when the test failed
                print(f"---- replica {i} ----\n{replica.output()}")


# -- SIGKILL of the driver, five times, with real runners --------------------------------------------


def runner_job() -> dict[str, Any]:
    # Small batches for many epochs: a round takes over a second (40 epochs took 0.3-0.5 s, and the job
    # ended before its fourth kill), so that five kills, each up to 1.5 s into a round, fall inside the
    # job's ten rounds rather than after it.
    args = {"epochs": 160, "batch_size": 4, "learning_rate": 0.05}
    return {
        "components": [{"type": "SoftmaxRegressionTrainer", "name": "trainer", "args": args}],
        "executors": {"*": "@trainer"},
    }


def submit_runner_job(replica: Serve, name: str, devices: int) -> str:
    control = cgrpc.ControlServiceStub(grpc.insecure_channel(replica.address))
    initial = {"weight": np.zeros((64, 10), np.float32), "bias": np.zeros((10,), np.float32)}
    data = weights_dxo(initial).SerializeToString(deterministic=True)
    sha = hashlib.sha256(data).hexdigest()
    header = dxo_pb2.BlobUploadHeader(sha256=sha, size_bytes=len(data))
    control.UploadModel(
        iter([cpb.UploadModelRequest(header=header), cpb.UploadModelRequest(chunk=data)]),
        metadata=replica.admin,
    )
    spec = cpb.JobSpec(
        name=name, job_data=json.dumps(runner_job()), initial_model=dxo_pb2.BlobRef(sha256=sha)
    )
    spec.fedavg.num_rounds = ROUNDS
    spec.fedavg.devices_per_round = devices
    spec.fedavg.min_results = devices
    spec.fedavg.round_timeout.FromSeconds(600)  # rounds close on their results; a bound, not a wait
    request = cpb.SubmitJobRequest(spec=spec, request_id=f"submit-{name}")
    return str(control.SubmitJob(request, metadata=replica.admin).job.job_id)


def start_runners(tmp: Path, cluster: Cluster, job_name: str, count: int) -> list[subprocess.Popen[bytes]]:
    data = tmp / "digits.npz"
    if not data.exists():
        digits_file(tmp)
    runners = []
    for i in range(count):
        command = [
            FEDLINK, "runner", "--server", ",".join(cluster.addresses), "--insecure",
            "--state-dir", str(tmp / f"device-{i}"), "--data", str(data),
            "--partition-id", str(i), "--num-partitions", str(count),
            "--job-name", job_name, "--job-timeout", "120s", "--task-wait", "2s", "--per-request", "5s",
        ]  # fmt: skip
        with (tmp / f"device-{i}.log").open("ab") as log:
            runners.append(subprocess.Popen(tied(command), stdout=log, stderr=subprocess.STDOUT))
    return runners


def wait_runners(tmp: Path, runners: list[subprocess.Popen[bytes]]) -> None:
    for i, runner in enumerate(runners):
        try:
            code = runner.wait(timeout=PROCESS_WAIT_S)
        except subprocess.TimeoutExpired:
            runner.kill()
            code = runner.wait()
        log = (tmp / f"device-{i}.log").read_text()
        assert code == 0, f"runner {i} exited {code}:\n{log[-3000:]}"


def kill_the_driver(cluster: Cluster, job_id: str, *, after_round: int, delay_s: float) -> float:
    """SIGKILLs the replica driving the job once ``after_round`` has closed and ``delay_s`` passed, waits
    for another to take the run over, and starts the killed one again without waiting for it (a start
    takes seconds, in which the job moves on a few rounds); the seconds from the kill to the takeover."""
    run = until(
        f"round {after_round} of the job to close",
        lambda: cluster.run_of(job_id),
        lambda r: (
            r is not None and ((r["round"] >= after_round and bool(r["owner"])) or r["state"] != "RUNNING")
        ),
    )
    assert run is not None and run["state"] == "RUNNING", f"the job ended before its kills: {dict(run or {})}"
    time.sleep(delay_s)
    victim = cluster.driver(job_id)
    owner = cluster.owner(victim)
    killed_at = time.monotonic()
    cluster.replicas[victim].kill()
    taken = until(
        "another replica to take the run over",
        lambda: cluster.run_of(job_id),
        lambda r: r is not None and r["owner"] not in (None, owner),
        within=60.0,
    )
    took = time.monotonic() - killed_at
    assert taken is not None and taken["state"] == "RUNNING", f"the job ended during the chaos: {taken!r}"
    cluster.launch(victim)  # back as a plain replica: the run is another's now, and only drivers are killed
    return took


def test_the_driver_sigkilled_five_times_loses_nothing_and_doubles_nothing(
    cluster_of: Callable[[int], Cluster], tmp_path: Path
) -> None:
    cluster = cluster_of(3)
    rng = random.Random(17)
    devices = 3
    runners = start_runners(tmp_path, cluster, "chaos", devices)
    try:
        job_id = submit_runner_job(cluster.replicas[0], "chaos", devices)
        # Spread over the job: the k-th kill once rounds 0, 1, 3, 5, 7 have closed, at a random moment
        # of the round then open (a task being trained, a report, a close, a checkpoint).
        takeovers = [
            kill_the_driver(cluster, job_id, after_round=closed, delay_s=rng.uniform(0.0, 1.5))
            for closed in (0, 1, 3, 5, 7)
        ]
        for replica in cluster.replicas:
            replica.wait_listening()  # every killed replica came back
        wait_runners(tmp_path, runners)
        state, chaos_model = final_model(cluster.replicas[0], job_id)
    finally:
        for runner in runners:
            if runner.poll() is None:
                runner.kill()

    worst = max(takeovers)
    print(
        f"\ntakeover after SIGKILL (s): {' '.join(f'{t:.2f}' for t in takeovers)}; worst {worst:.2f}, "
        f"target <= {TAKEOVER_TARGET_S:g} (lease {LEASE_S:g} s + 2 s): "
        f"{'met' if worst <= TAKEOVER_TARGET_S else 'MISSED'}"
    )
    assert state == states_pb2.JOB_STATE_FINISHED
    run = cluster.run_of(job_id)
    assert run is not None and run["lease_epoch"] >= 1 + KILLS, dict(run or {})
    accepted = cluster.accepted_per_round(job_id)
    device_ids = sorted({d for ids in accepted.values() for d in ids})
    assert len(device_ids) == devices
    assert accepted == dict.fromkeys(range(1, ROUNDS + 1), device_ids), "a result was lost or doubled"
    # Bounded for a loaded machine; the figure to read is the one printed above.
    assert worst < LEASE_S + 15.0, f"a takeover took {worst:.1f} s"

    # The same job, the same devices (identities kept in their state directories), no faults.
    calm_runners = start_runners(tmp_path, cluster, "calm", devices)
    try:
        calm = submit_runner_job(cluster.replicas[1], "calm", devices)
        wait_runners(tmp_path, calm_runners)
        calm_state, calm_model = final_model(cluster.replicas[2], calm)
    finally:
        for runner in calm_runners:
            if runner.poll() is None:
                runner.kill()
    assert calm_state == states_pb2.JOB_STATE_FINISHED
    assert sorted(chaos_model) == sorted(calm_model) == ["bias", "weight"]
    for name, value in calm_model.items():
        assert chaos_model[name].tobytes() == value.tobytes(), f"{name}: the interrupted run's model differs"
    assert np.abs(calm_model["weight"]).sum() > 0  # the devices learned something: the equality is not 0 == 0


# -- SIGSTOP, pg_terminate_backend, revocation: stub devices -------------------------------------------


def initial_model() -> dict[str, np.ndarray]:
    return {
        name: np.arange(np.prod(shape), dtype=np.float32).reshape(shape) for name, shape in SHAPES.items()
    }


def report_ok(device: Device, address: str, job_id: str, task: rpb.GetTaskResponse, round_no: int) -> None:
    reply = device.report(address, job_id, task, round_no, f"r{round_no}-{device.index}")
    assert reply.status == rpb.RUNNER_STATUS_OK, reply


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        return int(reply.status)


def test_a_driver_stopped_past_its_lease_is_fenced_off_when_it_wakes(
    cluster_of: Callable[[int], Cluster],
) -> None:
    cluster = cluster_of(2)
    initial = initial_model()
    devices = [Device(i) for i in range(3)]
    job_id = submit(cluster.replicas[0], initial, rounds=3, devices=len(devices))
    driver = cluster.driver(job_id)
    other = 1 - driver
    on_other = cluster.addresses[other]
    for device in devices:
        device.enroll(on_other)

    tasks = {d.index: d.next_task(on_other, job_id) for d in devices}
    for device in devices:
        report_ok(device, on_other, job_id, tasks[device.index], 1)
    until("round 1 to close", lambda: cluster.run_of(job_id), lambda r: r is not None and r["round"] >= 1)

    tasks = {d.index: d.next_task(on_other, job_id) for d in devices}
    for device in devices[:2]:
        report_ok(device, on_other, job_id, tasks[device.index], 2)
    paused = cluster.replicas[driver]
    assert paused.process is not None
    stopped_owner = cluster.owner(driver)
    paused.process.send_signal(signal.SIGSTOP)
    try:
        taken = until(
            "the other replica to take the run over",
            lambda: cluster.run_of(job_id),
            lambda r: r is not None and r["owner"] not in (None, stopped_owner),
            within=60.0,
        )
        assert taken is not None and cluster.index_of(str(taken["owner"])) == other
        # The round's last report, while the old driver sleeps with two of its three results folded.
        report_ok(devices[2], on_other, job_id, tasks[2], 2)
        until("round 2 to close", lambda: cluster.run_of(job_id), lambda r: r is not None and r["round"] >= 2)
    finally:
        paused.process.send_signal(signal.SIGCONT)

    # Awake, the old driver finds its lease gone at its first fenced write (its renewal or round 2's close).
    def refused() -> str:
        return paused.output()

    output = until(
        "the old driver to be refused",
        refused,
        lambda text: "stopped driving job" in text or "stopping its driver" in text,
        within=60.0,
    )
    assert "took it over (lease epoch" in output, output[-3000:]

    for device in devices:
        report_ok(device, on_other, job_id, device.next_task(on_other, job_id), 3)
    state, model = final_model(cluster.replicas[other], job_id)
    assert state == states_pb2.JOB_STATE_FINISHED
    for name, value in expected_model(initial, devices, rounds=3).items():
        assert model[name].tobytes() == value.tobytes(), f"{name}: a result was aggregated twice or lost"
    accepted = cluster.accepted_per_round(job_id)
    assert {r: len(ids) for r, ids in accepted.items()} == {1: 3, 2: 3, 3: 3}
    run = cluster.run_of(job_id)
    assert run is not None and run["lease_epoch"] == 2  # one takeover, and the old driver never took it back

    # It carries on as a plain replica: serving, and answering devices.
    address = cluster.addresses[driver]
    assert health(address) == health_pb2.HealthCheckResponse.SERVING
    assert devices[0].next_task(address, job_id).status == rpb.RUNNER_STATUS_DONE


def test_a_replica_whose_connections_are_terminated_reconnects_and_loses_nothing(
    cluster_of: Callable[[int], Cluster],
) -> None:
    cluster = cluster_of(2)
    initial = initial_model()
    devices = [Device(i) for i in range(3)]
    job_id = submit(cluster.replicas[0], initial, rounds=3, devices=len(devices))
    driver = cluster.driver(job_id)
    address = cluster.addresses[driver]
    name = f"{Cluster.application_name(driver)}%"
    for device in devices:
        device.enroll(address)

    def terminate() -> int:
        rows = cluster.query(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE $1",
            name,
        )
        return int(rows[0][0])

    terminated = 0
    for round_no in (1, 2, 3):
        tasks = {d.index: d.next_task(address, job_id) for d in devices}
        terminated += terminate()  # mid-round: the tasks are out, no result is in
        for device in devices:
            report_ok(device, address, job_id, tasks[device.index], round_no)
            terminated += terminate()  # after each acknowledgement: it must be durable already
    state, model = final_model(cluster.replicas[driver], job_id)
    assert state == states_pb2.JOB_STATE_FINISHED
    for key, value in expected_model(initial, devices, rounds=3).items():
        assert model[key].tobytes() == value.tobytes(), f"{key}: an acknowledged result was lost"
    assert {r: len(ids) for r, ids in cluster.accepted_per_round(job_id).items()} == {1: 3, 2: 3, 3: 3}
    assert terminated >= 12, f"only {terminated} connections were terminated: the faults did not happen"

    # It reconnected by itself: its store and its LISTEN connection are back, and it reports SERVING.
    names = until(
        "the replica's connections to come back",
        lambda: {
            str(r[0])
            for r in cluster.query(
                "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE $1", name
            )
        },
        lambda seen: {Cluster.application_name(driver), f"{Cluster.application_name(driver)}-notify"} <= seen,
        within=60.0,
    )
    assert names
    assert health(address) == health_pb2.HealthCheckResponse.SERVING


def test_a_device_revoked_on_one_replica_is_refused_on_its_next_call_to_another(
    cluster_of: Callable[[int], Cluster],
) -> None:
    cluster = cluster_of(2)
    a, b = cluster.replicas
    device = Device(0)
    device.enroll(b.address)
    bystander = Device(1)
    bystander.enroll(b.address)
    control = cgrpc.ControlServiceStub(grpc.insecure_channel(a.address))
    revoked = control.RevokeDevice(cpb.RevokeDeviceRequest(device_id=device.device_id), metadata=a.admin)
    assert revoked.device.state == states_pb2.DEVICE_STATE_REVOKED
    for address in (b.address, a.address):
        with pytest.raises(grpc.RpcError) as refused:
            device.stub(address).GetJob(rpb.GetJobRequest(protocol_version="1.0"), metadata=device.meta)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused.value
    # Only that device: another one's calls on B go on.
    bystander.stub(b.address).GetJob(rpb.GetJobRequest(protocol_version="1.0"), metadata=bystander.meta)
