"""The coordinator's background loops: a failing step is retried, a loop that cannot recover stops the
coordinator (health NOT_SERVING) instead of leaving it serving RPCs while it drives no job."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedlink.common.dxo import DXO, DataKind
from fedlink.server.app import Coordinator
from fedlink.server.domain import JobState, WorkflowSpec
from fedlink.server.protocol.control import JobSubmission
from fedlink.server.services.loops import BackgroundLoops, Loop, LoopGaveUp, LoopPolicy
from fedlink.server.settings import CoordinatorSettings


def local_settings(tmp_path: Path, **overrides: Any) -> CoordinatorSettings:
    """A coordinator on any loopback port, without TLS, its SQLite file in ``tmp_path``."""
    return CoordinatorSettings(
        data_dir=tmp_path / "data", listen_address="127.0.0.1:0", insecure=True, **overrides
    )


FAST = LoopPolicy(
    first_backoff=timedelta(milliseconds=10),
    max_backoff=timedelta(milliseconds=50),
    give_up_after=timedelta(seconds=30),
)


async def test_a_step_that_fails_is_retried_and_the_loop_goes_on() -> None:
    steps: list[str] = []

    async def step() -> None:
        steps.append("step")
        if len(steps) in (2, 3):
            raise ConnectionError("the database went away")

    async def pause() -> None:
        await asyncio.sleep(0)

    loops = BackgroundLoops(FAST)
    loops.add(Loop(name="scan", step=step, pause=pause))
    running = asyncio.create_task(loops.run())
    while len(steps) < 6:  # noqa: ASYNC110 - the loop under test has no event to offer
        await asyncio.sleep(0.01)
    assert not running.done()  # two failures in a row did not end it
    assert loops.loops[0].failures == 0  # and it counts from zero again after a success
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running


async def test_a_loop_that_keeps_failing_gives_up_and_the_others_stop() -> None:
    closed: list[str] = []

    async def broken() -> None:
        raise ConnectionError("no database")

    async def fine() -> None:
        await asyncio.sleep(0)

    async def close() -> None:
        closed.append("fine")

    policy = LoopPolicy(
        first_backoff=timedelta(milliseconds=5),
        max_backoff=timedelta(milliseconds=20),
        give_up_after=timedelta(milliseconds=200),
    )
    loops = BackgroundLoops(policy)
    loops.add(Loop(name="broken", step=broken, pause=fine))
    loops.add(Loop(name="fine", step=fine, pause=fine, close=close))
    started = time.monotonic()
    with pytest.raises(LoopGaveUp, match=r"'broken' failed for .* ConnectionError: no database"):
        await asyncio.wait_for(loops.run(), 10)
    assert time.monotonic() - started >= 0.2
    assert closed == ["fine"]  # the healthy loop was cancelled and closed, not left running


async def _health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int((await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)).status)


def _rename(db: Path, old: str, new: str) -> None:
    """Renames a table from outside the coordinator, as a botched manual migration would."""
    with sqlite3.connect(db, timeout=10) as conn:
        conn.execute(f"ALTER TABLE {old} RENAME TO {new}")


async def _submit(coordinator: Coordinator) -> str:
    assert coordinator.core is not None and coordinator.store is not None
    model = DXO(kind=DataKind.WEIGHTS, data={"w": np.zeros(3, np.float32)})
    ref = await coordinator.store.blobs.put_bytes(model.to_bytes())
    view = await coordinator.core.control_protocol.submit_job(
        JobSubmission(
            name="after-the-outage",
            workflow=WorkflowSpec(name="fedavg", config={"num_rounds": 1, "min_devices": 1}),
            job_data="{}",
            initial_model_sha256=ref.sha256,
            device_selector={},
        ),
        request_id="",
    )
    return view.job.job_id


async def test_a_scan_that_fails_once_is_retried_and_jobs_are_driven(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = local_settings(tmp_path)
    async with Coordinator(settings) as coordinator:
        assert coordinator.endpoint is not None and coordinator.core is not None
        db = settings.data_dir / "fedlink.db"
        with caplog.at_level(logging.ERROR, logger="fedlink.server.services.loops"):
            _rename(db, "jobs", "jobs_away")
            coordinator.core.supervisor.poke("-")  # scan now
            deadline = time.monotonic() + 20
            while not any("job-supervisor failed" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the scan never failed"
                await asyncio.sleep(0.05)
            _rename(db, "jobs_away", "jobs")
        assert await _health(coordinator.endpoint.address) == health_pb2.HealthCheckResponse.SERVING
        job_id = await _submit(coordinator)
        # The supervisor is scanning again: it takes the new job up (PENDING -> RUNNING).
        deadline = time.monotonic() + 20
        while (await coordinator.core.store.get_job(job_id)).state is JobState.PENDING:
            assert time.monotonic() < deadline, "the supervisor did not recover"
            await asyncio.sleep(0.05)
        assert coordinator.failure is None


async def test_a_loop_that_cannot_recover_turns_health_not_serving_and_stops(tmp_path: Path) -> None:
    settings = local_settings(
        tmp_path, loop_failure_timeout=timedelta(seconds=1), shutdown_grace=timedelta(seconds=1)
    )
    coordinator = Coordinator(settings)
    await coordinator.start()
    try:
        assert coordinator.endpoint is not None and coordinator.core is not None
        address = coordinator.endpoint.address
        channel = grpc.aio.insecure_channel(address)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        seen: list[int] = []
        async with asyncio.timeout(30):
            async for reply in watch:
                seen.append(reply.status)
                if len(seen) == 1:  # SERVING: now break the store for good
                    _rename(settings.data_dir / "fedlink.db", "jobs", "jobs_away")
                    coordinator.core.supervisor.poke("-")
                if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
            await coordinator.wait_closed()  # it stopped by itself
        await channel.close()
        assert seen[0] == health_pb2.HealthCheckResponse.SERVING
        assert seen[-1] == health_pb2.HealthCheckResponse.NOT_SERVING
        assert isinstance(coordinator.failure, LoopGaveUp)
        assert "job-supervisor" in str(coordinator.failure)
    finally:
        await coordinator.stop(grace=0)
