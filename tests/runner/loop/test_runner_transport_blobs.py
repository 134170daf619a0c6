"""Large payloads go through the blob streams both ways; settings layer defaults < TOML < env < flags."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from fedlink.common.dxo import DXO
from fedlink.common.errors import InvalidArgument
from fedlink.runner.config import ResolverRegistry
from fedlink.runner.context import Context, Signal
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


class _Gated:
    """Returns the model plus one, once the test opens the gate (a result the test can hold back)."""

    started = threading.Event()
    gate = threading.Event()

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        type(self).started.set()
        type(self).gate.wait(30)
        return DXO(kind=dxo.kind, data={k: v + 1 for k, v in dxo.data.items()}, meta={"num_examples": 3})


async def test_a_large_result_is_kept_with_its_blob_and_resent_after_an_outage(tmp_path: Path) -> None:
    # The coordinator goes away while the device trains: the large result is kept on disk as a request
    # naming a blob by hash plus the blob (serialized once), and a runner started later against the
    # restarted coordinator uploads that same blob and reports it; nothing is left behind.
    settings = coordinator_settings(
        tmp_path / "coordinator", inline_payload_bytes=512, component_types=("Gated",)
    )
    state, pending = tmp_path / "state", tmp_path / "state" / "pending"
    job = {"components": [{"type": "Gated", "name": "g"}], "executors": {"*": "@g"}}
    registry = ResolverRegistry({"Gated": _Gated})
    _Gated.gate.clear()
    _Gated.started.clear()
    async with serving(settings) as control:
        job_id = await control.submit(zero_softmax_model(), job, rounds=1, devices=1)
        first = Runner(
            "", None, {}, {}, 2.0,
            transport=transport(control.address, state, blob_threshold_bytes=512, chunk_bytes=256),
            resolver_registry=registry,
        )  # fmt: skip
        running = asyncio.create_task(first.run_async())
        # The device holds its task and trains (the model downloaded): now the coordinator goes.
        assert await asyncio.to_thread(_Gated.started.wait, 30), "the device never started training"
    # The coordinator is down; the device finishes and keeps its result.
    _Gated.gate.set()
    for _ in range(600):
        if list(pending.glob("*.pb")) and list(pending.glob("*.blob")):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("no pending request and blob on disk")
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    [kept] = pending.glob("*.blob")
    kept_sha = hashlib.sha256(kept.read_bytes()).hexdigest()
    assert DXO.from_bytes(kept.read_bytes()).data["weight"].max() == 1.0

    async with serving(settings) as control:
        second = Runner(
            "", None, {}, {}, 3.0,
            transport=transport(control.address, state, blob_threshold_bytes=512, chunk_bytes=256),
            resolver_registry=registry,
        )  # fmt: skip
        await asyncio.wait_for(second.run_async(), 60)
        store = control.coordinator.store
        assert store is not None
        for _ in range(600):
            if (await control.describe(job_id)).state == states_pb2.JOB_STATE_FINISHED:
                break
            await asyncio.sleep(0.05)
        run = await store.get_current_run(job_id)
        [result] = await store.list_results(run_id=run.run_id, accepted_only=False)
        assert result.accepted
        assert result.payload_sha256 == kept_sha
        final = await control.model(job_id)
    assert list(pending.iterdir()) == []
    assert float(final.data["weight"].max()) == 1.0


def test_a_kept_blob_without_its_request_is_removed(tmp_path: Path) -> None:
    from fedlink.runner.transport.state import PendingResults

    pending = PendingResults(tmp_path / "pending")
    pending.put("kept", b"request", blob=b"blob")
    (tmp_path / "pending" / "orphan.blob").write_bytes(b"left by a crash between the two writes")
    assert pending.items() == [("kept", b"request")]
    assert pending.blob("kept") == b"blob"
    assert sorted(p.name for p in (tmp_path / "pending").iterdir()) == ["kept.blob", "kept.pb"]
    moved = pending.reject("kept")
    assert moved.read_bytes() == b"request" and moved.with_suffix(".blob").read_bytes() == b"blob"
    assert pending.items() == [] and pending.blob("kept") is None


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
