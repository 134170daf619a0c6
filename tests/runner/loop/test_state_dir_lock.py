"""One runner per state directory: a second one on it stops at once, naming the directory and the
holder's pid, instead of acting as the same device; the directory is free again once the first is done.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from bench.orphans import tied
from fedlink.common.errors import FailedPrecondition
from fedlink.runner.loop import Runner

from .conftest import Control, transport

FEDLINK = str(Path(sys.executable).parent / "fedlink")


def runner(control: Control, state_dir: Path, job_timeout: float) -> Runner:
    return Runner("", None, {}, {}, job_timeout, transport=transport(control.address, state_dir))


def device_id(state_dir: Path) -> str:
    path = state_dir / "identity.json"
    return str(json.loads(path.read_text())["device_id"]) if path.exists() else ""


#: How long to wait for a runner (a process, on a loaded machine too) to get somewhere; a hang still fails.
PROCESS_WAIT_S = 180.0


async def until(what: str, predicate: object, within: float = PROCESS_WAIT_S) -> None:
    assert callable(predicate)
    deadline = asyncio.get_running_loop().time() + within
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_a_second_runner_in_process_is_refused_until_the_first_is_done(
    control: Control, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    first = runner(control, state, job_timeout=60.0)
    running = asyncio.create_task(first.run_async())
    await until("the first runner's enrolment", lambda: device_id(state))

    with pytest.raises(FailedPrecondition) as refused:
        await runner(control, state, job_timeout=1.0).run_async()
    assert refused.value.message.startswith(
        f"the runner state directory {state} is in use by another runner (pid {os.getpid()})"
    )

    first.stop()
    await asyncio.wait_for(running, timeout=30)
    again = runner(control, state, job_timeout=0.5)
    await asyncio.wait_for(again.run_async(), timeout=30)  # free: it opens, finds no job, ends
    assert again.transport.device_id == device_id(state)


@pytest.mark.slow  # two runner processes
async def test_a_second_runner_process_exits_1_naming_the_directory_and_the_holder(
    control: Control, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    command = [FEDLINK, "runner", "--server", control.address, "--insecure", "--state-dir", str(state),
               "--task-wait", "1s"]  # fmt: skip
    first = await asyncio.create_subprocess_exec(
        *tied(command),
        "--job-timeout",
        "0",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await until("the first runner's enrolment", lambda: device_id(state))
        enrolled_as = device_id(state)
        second = await asyncio.create_subprocess_exec(
            *tied(command),
            "--job-timeout",
            "30s",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(second.communicate(), timeout=PROCESS_WAIT_S)
        assert second.returncode == 1, output.decode()
        assert (
            f"the runner state directory {state} is in use by another runner (pid {first.pid})"
        ) in output.decode()
        assert device_id(state) == enrolled_as
    finally:
        if first.returncode is None:
            first.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(first.wait(), timeout=PROCESS_WAIT_S) == 0

    third = await asyncio.create_subprocess_exec(
        *tied(command),
        "--job-timeout",
        "1s",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(third.communicate(), timeout=PROCESS_WAIT_S)
    assert third.returncode == 0, output.decode()  # the first one let the directory go on exit
