"""Large payloads go through the blob streams both ways; settings layer defaults < TOML < env < flags."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

from fedlink.common.errors import InvalidArgument
from fedlink.runner.data import NpzDataSource
from fedlink.runner.loop import Runner
from fedlink.runner.settings import load_runner_settings
from fedlink.server.app import Coordinator
from fedlink.v1 import states_pb2

from .conftest import (
    coordinator_settings,
    digits_npz,
    serving,
    softmax_job,
    transport,
    zero_softmax_model,
)


async def test_task_and_result_travel_as_blobs_when_large(tmp_path: Path) -> None:
    settings = coordinator_settings(tmp_path / "coordinator", inline_payload_bytes=512)
    async with serving(settings) as control:
        [part] = digits_npz(tmp_path, 1)
        job_id = await control.submit(zero_softmax_model(), softmax_job(), rounds=2, devices=1)
        link = transport(control.address, tmp_path / "state", blob_threshold_bytes=512, chunk_bytes=256)
        runner = Runner("", NpzDataSource(part), {}, {}, 2.0, transport=link)
        await asyncio.wait_for(runner.run_async(), 30)

        assert (await control.describe(job_id)).state == states_pb2.JOB_STATE_FINISHED
        assert [r.outcome for r in runner.history] == ["SUCCEEDED", "SUCCEEDED"]
        coordinator = control.coordinator
        store = coordinator.store
        assert store is not None
        run = await store.get_current_run(job_id)
        tasks = await store.list_tasks(run.run_id)
        assert all(t.payload_sha256 for t in tasks)
        results = await store.list_results(run_id=run.run_id)
        # The result blobs are exactly what the device uploaded (content-addressed).
        for result in results:
            assert result.payload_sha256 is not None
            assert (await store.blobs.stat(result.payload_sha256)).size_bytes > 512
        # And they went by the streams: an inline result would be stored as a blob too.
        await asyncio.sleep(0.05)  # the server counts a call after its reply went out
        assert _ok_calls(coordinator, "UploadBlob") >= 2
        assert _ok_calls(coordinator, "DownloadBlob") >= 2


def _ok_calls(coordinator: Coordinator, method: str) -> float:
    """How many ``method`` calls of RunnerService the coordinator answered OK (its Prometheus counter)."""
    wanted = f'fedlink_rpc_requests_total{{code="OK",method="{method}",service="RunnerService"}}'
    for line in coordinator.telemetry.exposition().decode().splitlines():
        name, _, value = line.rpartition(" ")
        if name == wanted:
            return float(value)
    return 0.0


def test_settings_layer_toml_then_environment_then_flags(tmp_path: Path) -> None:
    config = tmp_path / "runner.toml"
    config.write_text(
        '[runner]\nserver = "toml:1"\ninsecure = true\nshutdown_grace = "5s"\njob_name = "a"\n'
        '[runner.device_info]\nsite = "lab"\n'
    )
    env = {"FEDLINK_SERVER": "env:2", "FEDLINK_JOB_NAME": "b", "FEDLINK_TASK_WAIT": "250ms"}
    settings = load_runner_settings(config, env, {"job_name": "c", "device_info": ["os=linux"]})
    assert settings.server == "env:2"
    assert settings.job_name == "c"
    assert settings.insecure is True
    assert settings.shutdown_grace == timedelta(seconds=5)
    assert settings.task_wait == timedelta(milliseconds=250)
    assert settings.device_info == {"os": "linux"}
    assert settings.job_timeout_seconds == float("inf")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "server is required"),
        ({"FEDLINK_SERVER": "h:1", "FEDLINK_SHUTDOWN_GRACE": "soon"}, "FEDLINK_SHUTDOWN_GRACE"),
        ({"FEDLINK_SERVER": "h:1", "FEDLINK_PARTITION_ID": "1"}, "go together"),
        (
            {"FEDLINK_SERVER": "h:1", "FEDLINK_INSECURE": "1", "FEDLINK_CA_CERT": "/x.pem"},
            "exclude each other",
        ),
    ],
)
def test_bad_settings_name_what_is_wrong(env: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        load_runner_settings(None, env, {})
