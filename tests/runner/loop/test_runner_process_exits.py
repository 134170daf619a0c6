"""``fedlink runner`` processes: how they end when the coordinator cannot be reached (exit 1, naming the
address and the cause, said once), when the CA file is not PEM (exit 2 at once), and what
``--log-format json`` writes (one object per line, the ids as fields)."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path

import pytest

from bench.orphans import tied
from fedlink.server.app import Coordinator
from fedlink.server.settings import CoordinatorSettings
from fedlink.server.tls import ensure_self_signed

from .conftest import Control, digits_npz, softmax_job, zero_softmax_model

pytestmark = pytest.mark.slow  # runner processes

FEDLINK = str(Path(sys.executable).parent / "fedlink")
#: A generous bound on a runner process's life here (a loaded machine starts Python slowly).
PROCESS_WAIT_S = 180.0


async def run_runner(*args: str) -> tuple[int, str, float]:
    """Runs ``fedlink runner ARGS`` to its end; returns its exit status, its output and how long it ran."""
    started = time.monotonic()
    process = await asyncio.create_subprocess_exec(
        *tied([FEDLINK, "runner", *args]),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout=PROCESS_WAIT_S)
    assert process.returncode is not None
    return process.returncode, output.decode(), time.monotonic() - started


@pytest.mark.parametrize(
    ("timeouts", "ending"),
    [
        (("--connect-timeout", "2s"), "gave up after 2s without a connection (connect_timeout): "),
        (("--connect-timeout", "0", "--job-timeout", "2s"), "within the job timeout (2s): "),
    ],
    ids=["connect-timeout", "job-timeout"],
)
async def test_an_unreachable_coordinator_ends_the_runner_with_exit_1_and_the_cause(
    tmp_path: Path, timeouts: tuple[str, ...], ending: str
) -> None:
    with socket.socket() as sock:  # bound, never listening: connections are refused
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
        code, output, took = await run_runner(
            "--server", address, "--insecure", "--state-dir", str(tmp_path / "state"), *timeouts
        )
    assert code == 1, output
    cause = f"cannot connect to the coordinator at {address}: connection refused"
    warnings = [line for line in output.splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and cause in warnings[0], output  # said once, however many retries
    last = output.strip().splitlines()[-1]
    assert " ERROR " in last and "runner stopped: Unavailable: " in last, output
    assert ending + cause in last, last
    assert took < PROCESS_WAIT_S / 2


async def test_a_ca_file_that_is_not_pem_exits_2_before_connecting(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("this is the join secret, not a certificate\n")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)  # a connection attempt would be seen here
        sock.setblocking(False)
        code, output, _ = await run_runner(
            "--server", f"127.0.0.1:{sock.getsockname()[1]}", "--ca-cert", str(ca),
            "--state-dir", str(tmp_path / "state"), "--connect-timeout", "0",
        )  # fmt: skip
        with pytest.raises(BlockingIOError):
            sock.accept()
    assert code == 2, output
    assert f"runner cannot start: the CA file {ca} holds no PEM certificate" in output
    assert "retry" not in output


async def test_json_logs_are_one_object_per_line_with_the_ids_as_fields(
    control: Control, tmp_path: Path
) -> None:
    (data,) = digits_npz(tmp_path, 1)
    job_id = await control.submit(zero_softmax_model(), softmax_job(), rounds=1, devices=1)
    state = tmp_path / "state"
    code, output, _ = await run_runner(
        "--server", control.address, "--insecure", "--state-dir", str(state), "--data", str(data),
        "--task-wait", "1s", "--job-timeout", "3s", "--log-format", "json",
    )  # fmt: skip
    assert code == 0, output
    records = [json.loads(line) for line in output.splitlines() if line.strip()]  # each line is JSON
    assert records and all({"ts", "level", "logger", "message"} <= record.keys() for record in records)
    device_id = json.loads((state / "identity.json").read_text())["device_id"]
    received = [r for r in records if r["message"].endswith(f"of job {job_id} received")]
    assert len(received) == 1, records
    assert received[0]["job_id"] == job_id and received[0]["task_id"]
    assert received[0]["device_id"] == device_id
    assert received[0]["logger"] == "fedlink.runner.loop" and received[0]["level"] == "INFO"
    # Once enrolled, every record carries the device id.
    enrolled = next(i for i, r in enumerate(records) if r["message"] == "enrolled")
    assert all(r.get("device_id") == device_id for r in records[enrolled:])


async def test_a_tls_failure_in_json_is_one_warning_among_json_lines_only(tmp_path: Path) -> None:
    # The runner trusts another CA than the coordinator's: every handshake fails the same way. gRPC's
    # own per-attempt lines would break the JSON stream and repeat what the runner says once.
    other_ca = ensure_self_signed(tmp_path / "other").ca_cert_path
    settings = CoordinatorSettings(data_dir=tmp_path / "data", listen_address="127.0.0.1:0")
    async with Coordinator(settings) as coordinator:
        assert coordinator.endpoint is not None
        address = coordinator.endpoint.address
        code, output, _ = await run_runner(
            "--server", address, "--ca-cert", str(other_ca), "--state-dir", str(tmp_path / "state"),
            "--connect-timeout", "3s", "--log-format", "json",
        )  # fmt: skip
    assert code == 1, output
    records = [json.loads(line) for line in output.splitlines()]  # nothing but JSON objects
    warnings = [r for r in records if r["level"] == "WARNING"]
    assert [(w["cause"], w["server"], w["rpc"]) for w in warnings] == [("unknown_ca", address, "Enroll")]
    assert f"the CA file {other_ca}" in warnings[0]["message"]
    last = records[-1]
    assert last["level"] == "ERROR" and last["message"].startswith("runner stopped: Unavailable")
    assert "not signed by a CA this runner trusts" in last["message"]
