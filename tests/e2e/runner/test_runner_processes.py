"""``fedlink runner`` processes against a coordinator: crash recovery, SIGTERM, an outage."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from pathlib import Path

import pytest

from fedlink.v1 import states_pb2

from .conftest import PROCESS_WAIT_S, Harness, digits_file, slow_job

pytestmark = pytest.mark.slow


async def wait_exit(process: object, within: float = PROCESS_WAIT_S) -> int:
    import subprocess

    assert isinstance(process, subprocess.Popen)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while process.poll() is None:
        if loop.time() > deadline:
            raise AssertionError(f"the runner did not exit within {within}s")
        await asyncio.sleep(0.05)
    return int(process.returncode)


def device_id(state_dir: Path) -> str:
    return str(json.loads((state_dir / "identity.json").read_text())["device_id"])


async def test_sigkill_between_result_and_acknowledgement_loses_nothing_and_doubles_nothing(
    harness: Harness, tmp_path: Path
) -> None:
    data = digits_file(tmp_path)
    job_id = await harness.submit(slow_job(epochs=25), name="crash")
    state = tmp_path / "device"
    first = harness.runner("device", data, "--job-name", "crash", "--job-timeout", "60s")

    await harness.wait_for_log("device", " received")
    # The executor is now training (seconds). Cut the network silently: the report will hang unanswered.
    harness.proxy.mode = "blackhole"
    pending = state / "pending"

    async def result_on_disk() -> bool:
        return any(pending.glob("*.pb"))

    await harness.wait_for("the finished result on disk", result_on_disk)
    first.send_signal(signal.SIGKILL)
    assert await wait_exit(first) == -signal.SIGKILL
    before = device_id(state)
    assert await harness.results(job_id) == []  # the coordinator never got it

    harness.proxy.cut()
    harness.proxy.mode = "forward"
    second = harness.runner("device", data, "--job-name", "crash", "--job-timeout", "60s")
    assert await wait_exit(second) == 0, harness.log("device")

    assert device_id(state) == before
    results = await harness.results(job_id)
    assert [(r.device_id, r.status.value) for r in results] == [(before, "SUCCEEDED")]
    assert await harness.job_state(job_id) == states_pb2.JOB_STATE_FINISHED
    assert list(pending.glob("*.pb")) == []


#: The RELEASED case's bound from SIGTERM to the release: far above the 0.3 s grace on a loaded machine,
#: far below the 30 s default grace and the training, which takes 30 s on a quiet machine.
RELEASED_WITHIN_S = 15.0


# COMPLETED: a grace (120 s) longer than the training (a few seconds quiet) on any machine the test
# should pass on; the runner exits as soon as it has reported, so a quiet run does not wait for it.
@pytest.mark.parametrize(
    ("grace", "epochs", "expect"), [("120s", 40, "COMPLETED"), ("0.3s", 400, "RELEASED")]
)
async def test_sigterm_exits_0_within_the_grace_with_the_result_or_a_release(
    harness: Harness, tmp_path: Path, grace: str, epochs: int, expect: str
) -> None:
    data = digits_file(tmp_path)
    job_id = await harness.submit(slow_job(epochs=epochs), name="term")
    process = harness.runner("device", data, "--job-name", "term", "--shutdown-grace", grace, via_proxy=False)

    await harness.wait_for_log("device", " received")
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    if expect == "RELEASED":

        async def released() -> bool:
            return [a.state.value for a in await harness.assignments(job_id)] == ["RELEASED"]

        await harness.wait_for("the release", released)
        took = time.monotonic() - started
        # Aborted right after the 0.3 s grace, not after the training (the process's exit is not timed:
        # a loaded machine takes seconds to tear an interpreter down).
        assert took < RELEASED_WITHIN_S, f"released {took:.1f} s after SIGTERM"
    assert await wait_exit(process) == 0, harness.log("device")
    [assignment] = await harness.assignments(job_id)
    assert assignment.state.value == expect, harness.log("device")
    # It signed off on its way out: not sampled again until it calls, without waiting for the window.
    assert harness.coordinator.store is not None
    device = await harness.coordinator.store.get_device(assignment.device_id)
    assert device.state.value == "OFFLINE", harness.log("device")
    if expect == "RELEASED":
        assert await harness.results(job_id) == []
    else:
        assert [r.status.value for r in await harness.results(job_id)] == ["SUCCEEDED"]


async def test_a_coordinator_outage_is_ridden_out_within_the_backoff_schedule(
    harness: Harness, tmp_path: Path
) -> None:
    data = digits_file(tmp_path)
    # No job yet: the runner keeps asking (GetJob every retry_after) through the proxy.
    a = harness.runner("a", data, "--job-name", "later", "--job-timeout", "0")
    await harness.wait_for_log("a", "enrolled")
    await asyncio.sleep(0.5)

    harness.proxy.mode = "refuse"
    harness.proxy.cut()
    outage_start = len(harness.proxy.accept_times)
    await asyncio.sleep(10)
    attempts = len(harness.proxy.accept_times) - outage_start
    harness.proxy.mode = "forward"

    # gRPC reconnects on the transport's schedule: first wait 0.5 s, x1.6 each time, jitter +-20%.
    wait, total, bound = 0.5 * 0.8, 0.0, 1
    while total + wait <= 10:
        total += wait
        wait *= 1.6
        bound += 1
    assert 1 <= attempts <= bound + 1, f"{attempts} connection attempts in 10 s (schedule allows {bound})"
    # The runner's own retries stay under their full-jitter ceilings (0.5 s doubling, at most 30 s).
    retries = [(int(n), float(d)) for n, d in re.findall(r"retry (\d+) in ([\d.]+)s", harness.log("a"))]
    assert retries, harness.log("a")
    for attempt, delay in retries:
        assert delay <= min(30.0, 0.5 * 2 ** (attempt - 1)) + 1e-3

    # After the outage the runner carries on: it takes the job, finishes it and exits.
    job_id = await harness.submit(slow_job(epochs=1), name="later")
    assert await wait_exit(a) == 0, harness.log("a")
    assert await harness.job_state(job_id) == states_pb2.JOB_STATE_FINISHED
