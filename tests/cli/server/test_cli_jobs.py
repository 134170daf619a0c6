"""``fedlink job …`` against a real coordinator: submit, list, show, watch, abort, delete, download."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedlink.server.cli.jobfile import load_job_file
from fedlink.server.settings import CoordinatorSettings
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import control_service_pb2_grpc as cgrpc
from fedlink.v1 import dxo_pb2

from .conftest import Cli, CoordinatorThread, CuttingProxy, StubDevice

INITIAL = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, np.float32)}


def write_job(
    folder: Path,
    *,
    rounds: int = 2,
    extra_fedavg: str = "",
    model: str = "initial.npz",
    section: str = "fedavg",
) -> Path:
    """A TOML job file beside an .npz initial model."""
    np.savez(folder / "initial.npz", w=INITIAL["w"], b=INITIAL["b"])
    path = folder / "job.toml"
    path.write_text(
        f"""
name = "digits"
model = "{model}"
device_selector = {{ platform = "test" }}

[{section}]
num_rounds = {rounds}
min_results = 2
min_devices = 2
round_timeout = "60s"
seed = 3
{extra_fedavg}

[job_data]
components = [ {{ type = "SoftmaxRegressionTrainer", name = "trainer", args = {{ epochs = 1 }} }} ]
executors = {{ "*" = "@trainer" }}
"""
    )
    return path


def submit(cli: Cli, job_file: Path) -> str:
    result = cli("job", "submit", str(job_file))
    assert result.exit_code == 0, result.output
    return result.stdout.strip()


def test_submit_then_list_and_show_describe_the_job(cli: Cli, tmp_path: Path) -> None:
    job_file = write_job(tmp_path)
    job_id = submit(cli, job_file)

    table = cli("job", "list")
    assert table.exit_code == 0, table.output
    header, row = table.stdout.splitlines()
    assert header.split()[:3] == ["JOB", "ID", "NAME"]
    assert row.split()[:2] == [job_id, "digits"]
    assert row.split()[2] in ("PENDING", "RUNNING")  # running once the supervisor took it up

    listed = json.loads(cli("job", "list", "--format", "json").stdout)
    assert [j["job_id"] for j in listed] == [job_id]

    shown = cli("job", "show", job_id, "--format", "json")
    assert shown.exit_code == 0, shown.output
    job = json.loads(shown.stdout)
    assert job["name"] == "digits"
    assert job["state"] in ("PENDING", "RUNNING")
    assert job["device_selector"] == {"platform": "test"}
    assert job["fedavg"]["num_rounds"] == 2
    assert job["fedavg"]["min_results"] == 2
    assert job["fedavg"]["round_timeout_s"] == 60.0
    assert job["fedavg"]["seed"] == 3
    assert job["job_data"]["executors"] == {"*": "@trainer"}
    assert len(job["initial_model"]["sha256"]) == 64
    # DescribeJob says the size of the uploaded model (a serialized DXO).
    assert job["initial_model"]["size_bytes"] == len(load_job_file(job_file).model_bytes)
    assert job["workflow"] == "fedavg"
    assert job["completed_rounds"] == 0

    text = cli("job", "show", job_id)
    assert text.exit_code == 0
    assert f"job:      {job_id}" in text.stdout
    # Round 1 is in progress once the job runs (it waits for its devices); none before.
    assert "round:    1 of 2 (0 completed)" in text.stdout or "round:    0 of 2 (0 completed)" in text.stdout
    assert "workflow: fedavg (synchronous rounds" in text.stdout


STRATEGY_KEYS = {
    "fedavg": "",
    "fedavgm": "server_momentum = 0.9",
    "fedadam": "server_learning_rate = 0.05\nbias_correction = false",
    "fedyogi": "beta_2 = 0.9",
    "fedadagrad": "tau = 0.01",
    "fedmedian": "devices_per_round = 2",
    "fedtrimmedavg": "devices_per_round = 3\nbeta = 0.3",
    "krum": "devices_per_round = 3\nnum_malicious = 1",
}


@pytest.mark.parametrize("section", sorted(STRATEGY_KEYS))
def test_each_strategy_is_submitted_from_its_job_file_section_and_shown(
    cli: Cli, tmp_path: Path, section: str
) -> None:
    job_id = submit(cli, write_job(tmp_path, section=section, extra_fedavg=STRATEGY_KEYS[section]))
    job = json.loads(cli("job", "show", job_id, "--format", "json").stdout)
    assert job["workflow"] == section
    assert job[section]["num_rounds"] == 2 and job[section]["seed"] == 3
    for line in filter(None, STRATEGY_KEYS[section].split("\n")):
        key, value = (part.strip() for part in line.split("="))
        assert job[section][key] == json.loads(value), key
    text = cli("job", "show", job_id).stdout
    assert f"workflow: {section} (" in text
    assert f"{section + ':':<10}num_rounds=2" in text
    cli("job", "abort", job_id)


def test_list_filters_by_state_and_limits(cli: Cli, tmp_path: Path) -> None:
    first = submit(cli, write_job(tmp_path))
    second = submit(cli, write_job(tmp_path))
    assert cli("job", "abort", first).exit_code == 0

    def ids(*args: str) -> list[str]:
        result = cli("job", "list", "--format", "json", *args)
        assert result.exit_code == 0, result.output
        return [j["job_id"] for j in json.loads(result.stdout)]

    assert ids() == [second, first]  # newest first
    assert ids("--state", "aborted") == [first]
    assert ids("--state", "FINISHED") == []
    assert ids("--limit", "1") == [second]


def test_abort_then_delete_and_show_reports_not_found(cli: Cli, tmp_path: Path) -> None:
    job_id = submit(cli, write_job(tmp_path))
    running = cli("job", "delete", job_id)
    assert running.exit_code == 1
    assert running.stderr.startswith("error: FAILED_PRECONDITION: ")
    assert "Traceback" not in running.output

    aborted = cli("job", "abort", job_id, "--reason", "wrong data")
    assert aborted.exit_code == 0, aborted.output
    assert aborted.stdout.strip() == f"job {job_id} ABORTED"
    assert json.loads(cli("job", "show", job_id, "--format", "json").stdout)["message"] == "wrong data"

    watched = cli("job", "watch", job_id)
    assert watched.exit_code == 1  # the job ended, but not FINISHED
    assert "job ABORTED: wrong data" in watched.stdout

    deleted = cli("job", "delete", job_id)
    assert deleted.exit_code == 0, deleted.output
    assert deleted.stdout.startswith(f"job {job_id} deleted; freed ")
    gone = cli("job", "show", job_id)
    assert gone.exit_code == 1
    assert gone.stderr.startswith("error: NOT_FOUND: ")


def test_a_job_run_to_the_end_is_watched_live_and_downloaded(
    cli: Cli, coordinator: CoordinatorThread, tmp_path: Path
) -> None:
    job_id = submit(cli, write_job(tmp_path, rounds=2))

    async def devices() -> list[int]:
        async with grpc.aio.insecure_channel(coordinator.address) as channel:
            one = await StubDevice(channel).enroll()
            two = await StubDevice(channel).enroll()
            return list(await asyncio.gather(one.train(1.0), two.train(3.0)))

    training = coordinator.submit(devices())
    watched = cli("job", "watch", job_id)
    assert training.result(timeout=60) == [2, 2]
    assert watched.exit_code == 0, watched.output
    lines = watched.stdout.splitlines()
    assert any(line.endswith("round 1 started: 2 devices") for line in lines), lines
    assert any(line.endswith("round 2 closed: 2 results") for line in lines), lines
    assert any("round 1: result from dev-" in line and line.endswith("succeeded (2 in)") for line in lines)
    assert lines[-1].endswith("job FINISHED")

    events = [
        json.loads(line) for line in cli("job", "watch", job_id, "--format", "json").stdout.splitlines()
    ]
    assert [e["sequence"] for e in events] == sorted(e["sequence"] for e in events)
    assert [e["round"] for e in events if e["event"] == "round_closed"] == [1, 2]
    # Every result, as it came: each device's once per round, counted up, before its round closed.
    received = [e for e in events if e["event"] == "result_received"]
    assert sorted((e["round"], e["num_results"]) for e in received) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert {e["status"] for e in received} == {"SUCCEEDED"}
    assert len({(e["round"], e["device_id"]) for e in received}) == 4
    closed = {e["round"]: e["sequence"] for e in events if e["event"] == "round_closed"}
    assert all(e["sequence"] < closed[e["round"]] for e in received)
    rounds_only = cli("job", "watch", job_id, "--no-results").stdout.splitlines()
    assert rounds_only == [line for line in lines if ": result from " not in line]
    assert len(rounds_only) == len(lines) - 4

    final = tmp_path / "final.npz"
    downloaded = cli("job", "download", job_id, "-o", str(final))
    assert downloaded.exit_code == 0, downloaded.output
    assert "round 2" in downloaded.stdout
    assert "note:" not in downloaded.stderr  # a finished job's model
    with np.load(final) as model:
        # Each round adds the mean of the two devices' updates, (1 + 3) / 2 = 2, to every weight.
        assert set(model.files) == {"w", "b"}
        np.testing.assert_array_equal(model["w"], INITIAL["w"] + 4)
        np.testing.assert_array_equal(model["b"], INITIAL["b"] + 4)
    first_round = tmp_path / "round1.npz"
    assert cli("job", "download", job_id, "--round", "1", "-o", str(first_round)).exit_code == 0
    with np.load(first_round) as model:
        np.testing.assert_array_equal(model["w"], INITIAL["w"] + 2)

    shown = json.loads(cli("job", "show", job_id, "--format", "json").stdout)
    assert (shown["state"], shown["current_round"]) == ("FINISHED", 2)


def test_devices_failure_reasons_reach_watch_show_and_the_failed_jobs_message(
    cli: Cli, coordinator: CoordinatorThread, tmp_path: Path
) -> None:
    # No retries: the first round's failures end the job (the default, 2, would send each device 3 tasks).
    job_id = submit(cli, write_job(tmp_path, rounds=1, extra_fedavg="max_round_retries = 0"))
    # What a runner sends when its data does not fit the model; a second line and an escape sequence
    # that must not reach an operator's terminal as such.
    raw = "InvalidArgument: the 'train' dataset has 4 features per sample;\n the model expects 7\x1b[2J"
    shown = "InvalidArgument: the 'train' dataset has 4 features per sample; the model expects 7 [2J"

    async def devices() -> list[int]:
        async with grpc.aio.insecure_channel(coordinator.address) as channel:
            one = await StubDevice(channel).enroll()
            two = await StubDevice(channel).enroll()
            return list(await asyncio.gather(one.train(1.0, error=raw), two.train(1.0, error=raw)))

    training = coordinator.submit(devices())
    watched = cli("job", "watch", job_id)
    assert training.result(timeout=60) == [1, 1]
    assert watched.exit_code == 1, watched.output  # the job failed
    failed_lines = [line for line in watched.stdout.splitlines() if ": result from " in line]
    assert len(failed_lines) == 2 and all(line.endswith(f"failed (0 in): {shown}") for line in failed_lines)
    why = f'round 1 got 0 of the 2 results it needs; 2 failed: "{shown}" (2)'
    assert watched.stdout.splitlines()[-1].endswith(f"job FAILED: {why}")

    events = [
        json.loads(line) for line in cli("job", "watch", job_id, "--format", "json").stdout.splitlines()
    ]
    received = [e for e in events if e["event"] == "result_received"]
    assert [(e["status"], e["error"]) for e in received] == [("FAILED", shown)] * 2
    assert json.loads(cli("job", "show", job_id, "--format", "json").stdout)["message"] == why
    assert f"message: {why}" in " ".join(cli("job", "show", job_id).stdout.split())


def test_download_of_a_running_job_says_it_is_the_initial_model_not_a_result(
    cli: Cli, tmp_path: Path
) -> None:
    job_id = submit(cli, write_job(tmp_path))  # no devices: it stays before its first round
    target = tmp_path / "early.npz"
    downloaded = cli("job", "download", job_id, "-o", str(target))
    assert downloaded.exit_code == 0, downloaded.output
    assert downloaded.stdout.startswith("wrote the initial model (round 0)")
    assert downloaded.stderr.startswith(f"note: job {job_id} is ")
    assert "no round has completed: the initial model" in downloaded.stderr
    with np.load(target) as model:
        np.testing.assert_array_equal(model["w"], INITIAL["w"])


def test_download_of_a_round_that_was_not_kept_is_not_found(cli: Cli, tmp_path: Path) -> None:
    job_id = submit(cli, write_job(tmp_path))
    result = cli("job", "download", job_id, "--round", "7", "-o", str(tmp_path / "x.npz"))
    assert result.exit_code == 1
    assert result.stderr.startswith("error: NOT_FOUND: ")
    assert not (tmp_path / "x.npz").exists()


def test_download_refuses_a_target_that_is_not_npz(cli: Cli, tmp_path: Path) -> None:
    result = cli("job", "download", "job-x", "-o", str(tmp_path / "model.bin"))
    assert result.exit_code == 2
    assert "error: " in result.stderr and ".npz" in result.stderr


def test_submit_json_format_and_idempotent_model_upload(
    cli: Cli, coordinator: CoordinatorThread, tmp_path: Path
) -> None:
    job_file = write_job(tmp_path)
    first = json.loads(cli("job", "submit", str(job_file), "--format", "json").stdout)
    second = json.loads(cli("job", "submit", str(job_file), "--format", "json").stdout)
    # The model bytes are deterministic, so the second upload is the same blob.
    assert first["initial_model"]["sha256"] == second["initial_model"]["sha256"]
    assert first["job_id"] != second["job_id"]
    assert first["state"] == "PENDING"  # as SubmitJob returned it


def test_submit_resumes_an_upload_the_coordinator_holds_part_of(
    cli: Cli, coordinator: CoordinatorThread, tmp_path: Path
) -> None:
    big = np.random.default_rng(0).normal(size=(700, 1000)).astype(np.float32)  # ~2.8 MB
    np.savez(tmp_path / "big.npz", w=big)
    job_file = write_job(tmp_path, model="big.npz")
    data = load_job_file(job_file).model_bytes
    sha = hashlib.sha256(data).hexdigest()
    metadata = (("authorization", f"Bearer {coordinator.admin_token}"),)
    half = 1024 * 1024

    def first_half() -> Iterator[cpb.UploadModelRequest]:
        yield cpb.UploadModelRequest(header=dxo_pb2.BlobUploadHeader(sha256=sha, size_bytes=len(data)))
        yield cpb.UploadModelRequest(chunk=data[:half])

    with grpc.insecure_channel(coordinator.address) as channel:
        stub = cgrpc.ControlServiceStub(channel)
        with pytest.raises(grpc.RpcError):  # the stream ends early: the coordinator keeps what came
            stub.UploadModel(first_half(), metadata=metadata)
        held = stub.GetModelUploadStatus(cpb.GetModelUploadStatusRequest(sha256=sha), metadata=metadata)
        assert (held.received_bytes, held.complete) == (half, False)

        job_id = submit(cli, job_file)  # a fresh upload from 0 would be refused: it must resume
        done = stub.GetModelUploadStatus(cpb.GetModelUploadStatusRequest(sha256=sha), metadata=metadata)
        assert done.complete and done.received_bytes == len(data)
        job = stub.DescribeJob(cpb.DescribeJobRequest(job_id=job_id), metadata=metadata).job
        assert job.spec.initial_model.sha256 == sha


def test_wrong_admin_token_is_unauthenticated(cli: Cli) -> None:
    result = cli("job", "list", "--admin-token", "not-the-token")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: UNAUTHENTICATED: ")
    assert "Traceback" not in result.output


def test_missing_admin_token_file_is_a_usage_error(cli: Cli, tmp_path: Path) -> None:
    result = cli("job", "list", env={"FEDLINK_ADMIN_TOKEN": "", "FEDLINK_DATA_DIR": str(tmp_path / "none")})
    assert result.exit_code == 2
    assert "no admin token" in result.stderr
    assert str(tmp_path / "none" / "admin-token") in result.stderr


def test_no_coordinator_listening_is_unavailable(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    result = Cli()(
        "job",
        "list",
        "--server",
        f"127.0.0.1:{port}",
        "--insecure",
        "--admin-token",
        "x",
        "--data-dir",
        str(tmp_path),
    )
    assert result.exit_code == 1
    assert result.stderr.startswith("error: UNAVAILABLE: ")
    assert time.monotonic() - started < 30


def test_job_commands_work_over_tls_with_only_the_data_dir(tmp_path: Path) -> None:
    data = tmp_path / "data"
    settings = CoordinatorSettings(data_dir=data, listen_address="127.0.0.1:0", open_enrolment=True)
    with CoordinatorThread(settings) as running:
        port = running.address.rsplit(":", 1)[1]
        # No token, no CA, no --insecure: both come from the data directory.
        result = Cli()("job", "list", "--server", f"localhost:{port}", "--data-dir", str(data))
        assert result.exit_code == 0, result.output
        assert result.stdout.strip() == "(none)"
        plaintext = Cli()(
            "job", "list", "--server", f"localhost:{port}", "--data-dir", str(data), "--insecure"
        )
        assert plaintext.exit_code == 1
        assert plaintext.stderr.startswith("error: UNAVAILABLE: ")


def test_watch_of_an_unknown_job_fails_at_once(cli: Cli) -> None:
    # A permanent error is not retried like a dropped stream.
    started = time.monotonic()
    result = cli("job", "watch", "no-such-job")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: NOT_FOUND: ")
    assert time.monotonic() - started < 5


def test_submit_resumes_an_upload_whose_connection_dropped(
    cli: Cli, coordinator: CoordinatorThread, tmp_path: Path
) -> None:
    big = np.random.default_rng(1).normal(size=(900, 1000)).astype(np.float32)  # ~3.6 MB: 4 chunks
    np.savez(tmp_path / "big.npz", w=big)
    job_file = write_job(tmp_path, model="big.npz")
    sha = hashlib.sha256(load_job_file(job_file).model_bytes).hexdigest()
    proxy = CuttingProxy(coordinator.address, cut_after=2 * 1024 * 1024 + 100_000)
    try:
        result = cli(
            "job", "submit", str(job_file), "--format", "json", env={"FEDLINK_SERVER": proxy.address}
        )
    finally:
        proxy.close()
    assert result.exit_code == 0, result.output
    assert proxy.cuts == 1 and proxy.connections >= 2
    resumed = [line for line in result.stderr.splitlines() if line.startswith("upload interrupted")]
    assert len(resumed) == 1, result.stderr
    offset = int(resumed[0].split("resuming from byte ")[1].split()[0])
    assert 0 < offset < len(load_job_file(job_file).model_bytes)  # it went on from where it was cut
    assert json.loads(result.stdout)["initial_model"]["sha256"] == sha
