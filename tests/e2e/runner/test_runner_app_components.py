"""A job whose trainer is the app's own (``pkg.module:Name``), on ``fedlink runner`` processes: refused
by a runner whose owner did not allow the module — the operator reads why in ``fedlink job show`` —
and trained by one that allows it (``FEDLINK_ALLOW_COMPONENTS``, ``--allow-components``)."""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
from pathlib import Path

import numpy as np
import pytest

from bench.orphans import tied
from fedlink.v1 import states_pb2

from .conftest import FEDLINK, PROCESS_WAIT_S, Harness, digits_file

APP = """
from fedlink.runner.executors import SoftmaxRegressionTrainer


class Trainer(SoftmaxRegressionTrainer):
    '''The app's trainer: the built-in softmax regression under the app's own name.'''
"""

JOB = """
name = "{name}"
model = "initial.npz"

[fedavg]
num_rounds = 1
devices_per_round = 1
min_results = 1
round_failure_policy = "fail"   # the one device's failure ends the job, with its reason
round_timeout = "600s"

[job_data]
components = [{{ type = "fedlink_e2e_app.nets:Trainer", name = "trainer", args = {{ epochs = 1 }} }}]
executors = {{ "*" = "@trainer" }}
"""


def app_folder(tmp: Path) -> Path:
    """The app's package, as a device owner installs it (here: a folder on PYTHONPATH)."""
    package = tmp / "app" / "fedlink_e2e_app"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(textwrap.dedent(APP))
    return package.parent


async def cli(harness: Harness, *args: str) -> str:
    """``fedlink ARGS`` against the harness's coordinator, which runs on this event loop: awaited."""
    command = [FEDLINK, *args, "--server", harness.address, "--insecure"]
    process = await asyncio.create_subprocess_exec(
        *tied(command),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "FEDLINK_ADMIN_TOKEN": harness.coordinator.admin_token},
    )
    out, err = await asyncio.wait_for(process.communicate(), PROCESS_WAIT_S)
    assert process.returncode == 0, f"fedlink {' '.join(args)} failed: {out.decode()}{err.decode()}"
    return out.decode()


async def submit(harness: Harness, name: str) -> str:
    folder = harness.tmp / name
    folder.mkdir()
    np.savez(folder / "initial.npz", weight=np.zeros((64, 10), np.float32), bias=np.zeros(10, np.float32))
    (folder / "job.toml").write_text(JOB.format(name=name))
    reply = await cli(harness, "job", "submit", str(folder / "job.toml"), "--format", "json")
    return str(json.loads(reply)["job_id"])


async def test_a_runner_refuses_a_module_its_owner_did_not_allow_and_trains_once_allowed(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = digits_file(harness.tmp)
    app = app_folder(harness.tmp)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(app), os.environ.get("PYTHONPATH")])))

    refused = await submit(harness, "refused")
    harness.runner("plain", data, "--job-name", "refused", "--job-timeout", "30s", via_proxy=False)
    await harness.wait_for("the refused job to end", lambda: ended(harness, refused))
    shown = await cli(harness, "job", "show", refused)
    assert "state:    FAILED" in shown, shown
    # The operator sees the device's reason: the type, its module, and the setting that would allow it.
    for said in (
        "ComponentNotAllowed",
        "'fedlink_e2e_app.nets:Trainer' from module 'fedlink_e2e_app.nets'",
        "allow_components",
        "--allow-components",
    ):
        assert said in shown, shown
    assert "ComponentNotAllowed" in harness.log("plain")

    allowed = await submit(harness, "allowed")
    harness.runner(
        "allowing",
        data,
        *("--job-name", "allowed", "--job-timeout", "30s", "--allow-components", "fedlink_e2e_app.*"),
        via_proxy=False,
    )
    await harness.wait_for("the allowed job to end", lambda: ended(harness, allowed))
    shown = await cli(harness, "job", "show", allowed)
    assert "state:    FINISHED" in shown, f"{shown}\n{harness.log('allowing')}"


async def ended(harness: Harness, job_id: str) -> bool:
    return await harness.job_state(job_id) in (states_pb2.JOB_STATE_FAILED, states_pb2.JOB_STATE_FINISHED)
