"""A runner given several coordinator addresses (``--server a,b``) moves to the next one when an address
cannot serve (refused, gone, UNAVAILABLE) and stays put when a coordinator answers with an error of its
own. Real coordinators on 127.0.0.1:0; the two-replica test runs two on ONE PostgreSQL database (each
with its own data directory, as one coordinator per data directory requires).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from fedlink.common.errors import Unauthenticated, Unavailable
from fedlink.runner.data import NpzDataSource
from fedlink.runner.loop import Runner
from fedlink.runner.transport.backoff import Backoff
from fedlink.runner.transport.state import StateDir
from fedlink.server.settings import CoordinatorSettings
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import states_pb2

from .conftest import (
    APP_TYPES,
    Control,
    coordinator_settings,
    digits_npz,
    serving,
    softmax_job,
    transport,
    zero_softmax_model,
)

#: The ``closed_ports`` fixture (tests/conftest.py): ``with closed_ports(n) as addresses``.
ClosedPorts = Callable[[int], AbstractContextManager[list[str]]]

TRANSPORT_LOGGER = "fedlink.runner.transport.grpc_transport"


async def device_ids(control: Control) -> list[str]:
    reply = await control.stub.ListDevices(cpb.ListDevicesRequest(page_size=100), metadata=control.metadata)
    return [device.device_id for device in reply.devices]


async def test_a_dead_first_address_is_passed_over_for_the_live_one(
    control: Control, tmp_path: Path, caplog: pytest.LogCaptureFixture, closed_ports: ClosedPorts
) -> None:
    [part] = digits_npz(tmp_path, 1)
    job_id = await control.submit(zero_softmax_model(), softmax_job(), rounds=2, devices=1)
    with closed_ports(1) as [dead]:
        link = transport(f"{dead},{control.address}", tmp_path / "state")
        runner = Runner("", NpzDataSource(part), {}, {}, 2.0, transport=link)
        with caplog.at_level(logging.INFO, logger=TRANSPORT_LOGGER):
            await asyncio.wait_for(runner.run_async(), timeout=60)
    job = await control.describe(job_id)
    assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
    assert [r.outcome for r in runner.history] == ["SUCCEEDED", "SUCCEEDED"]
    assert link.address == control.address
    assert link.failed_attempts[0] == ("Enroll", "UNAVAILABLE"), link.failed_attempts
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # one failure at the dead address, then the live one serves
    assert f"cannot connect to the coordinator at {dead}: connection refused" in warnings[0], warnings
    assert f"trying {control.address} now" in warnings[0], warnings
    moved = [r.getMessage() for r in caplog.records if "now using the coordinator" in r.getMessage()]
    assert moved == [f"now using the coordinator at {control.address} (moved from {dead})"], moved


async def test_an_error_the_coordinator_answers_is_not_a_reason_to_move(tmp_path: Path) -> None:
    # The first coordinator wants a join secret; the second would enrol anyone. A runner with the wrong
    # secret must hear the first one's refusal, not get itself enrolled by the second.
    strict = CoordinatorSettings(
        data_dir=tmp_path / "strict",
        listen_address="127.0.0.1:0",
        insecure=True,
        join_secret="the right secret",
        component_types=APP_TYPES,
    )
    async with serving(strict) as first, serving(coordinator_settings(tmp_path / "open")) as second:
        link = transport(f"{first.address},{second.address}", tmp_path / "state", join_secret="wrong")
        try:
            with pytest.raises(Unauthenticated, match="join secret"):
                await asyncio.wait_for(link.open(), timeout=30)
        finally:
            await link.close()
        assert link.failed_attempts == [("Enroll", "UNAUTHENTICATED")]
        assert link.address == first.address
        assert await device_ids(second) == []


async def test_when_every_address_is_down_the_error_names_each_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, closed_ports: ClosedPorts
) -> None:
    with closed_ports(2) as dead:
        link = transport(
            ",".join(dead),
            tmp_path / "state",
            connect_timeout=timedelta(seconds=1.5),
            backoff=Backoff(base=timedelta(milliseconds=50), cap=timedelta(milliseconds=200)),
        )
        started = time.monotonic()
        with caplog.at_level(logging.DEBUG, logger=TRANSPORT_LOGGER), pytest.raises(Unavailable) as gone:
            await link.open()
        took = time.monotonic() - started
        await link.close()
    message = str(gone.value)
    assert message.startswith("Enroll: gave up after 1.5s without a connection (connect_timeout): "), message
    assert f"cannot connect to any of the coordinators at {dead[0]}, {dead[1]}: " in message, message
    for address in dead:
        assert f"{address}: connection refused" in message, message
    assert took >= 1.5 - 0.05, f"gave up after {took:.2f}s"
    # Gone round more than once, with a backoff between rounds; each address warned about once.
    assert len(link.failed_attempts) > 2 * len(dead), link.failed_attempts
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sorted(w.split(": connection refused")[0] for w in warnings) == sorted(
        f"Enroll: cannot connect to the coordinator at {address}" for address in dead
    ), warnings
    retries_at = [
        r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and " retry " in r.getMessage()
    ]
    assert retries_at, "no round of both addresses ended in a backoff"


async def test_a_replica_that_goes_away_mid_job_leaves_the_runner_on_the_other(
    pg_database: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Two replicas on one PostgreSQL database, each with its own data directory, sharing no file
    # system: blob bytes in the database, so the model submitted through the second is read through
    # the first (under a per-replica blob_dir it would be missing there).
    shared: dict[str, Any] = {
        "db_url": pg_database,
        "admin_token": "one token for both",
        "blobs_in_database": True,
    }
    [part] = digits_npz(tmp_path, 1)
    async with contextlib.AsyncExitStack() as first_stack:
        first = await first_stack.enter_async_context(
            serving(coordinator_settings(tmp_path / "a", auto_migrate=True, **shared))
        )
        async with serving(coordinator_settings(tmp_path / "b", **shared)) as second:
            job_id = await second.submit(zero_softmax_model(), softmax_job(), rounds=3, devices=1)
            link = transport(f"{first.address},{second.address}", tmp_path / "state")
            runner = Runner("", NpzDataSource(part), {}, {}, 5.0, transport=link)
            with caplog.at_level(logging.INFO, logger=TRANSPORT_LOGGER):
                running = asyncio.ensure_future(runner.run_async())
                try:
                    deadline = time.monotonic() + 60
                    while (await second.describe(job_id)).completed_rounds < 1:
                        assert not running.done(), running
                        assert time.monotonic() < deadline, "round 1 did not close within 60s"
                        await asyncio.sleep(0.05)
                    assert link.address == first.address  # everything so far went to the first
                    device_id = link.device_id
                    await first_stack.aclose()  # the first replica goes away, mid-job
                    await asyncio.wait_for(asyncio.shield(running), timeout=150)
                finally:
                    if not running.done():
                        runner.stop(grace=0)
                        await asyncio.wait_for(running, timeout=30)
            job = await second.describe(job_id)
            assert job.state == states_pb2.JOB_STATE_FINISHED, job.message
            assert [r.outcome for r in runner.history] == ["SUCCEEDED"] * 3
            assert link.address == second.address
            # The same device, with the credential the first replica issued, all along.
            identity = StateDir(tmp_path / "state").load_identity()
            assert identity is not None and identity.device_id == device_id
            assert await device_ids(second) == [device_id]
            assert "UNAVAILABLE" in {code for _, code in link.failed_attempts}, link.failed_attempts
    moved = [r.getMessage() for r in caplog.records if "now using the coordinator" in r.getMessage()]
    assert moved == [f"now using the coordinator at {second.address} (moved from {first.address})"], moved
