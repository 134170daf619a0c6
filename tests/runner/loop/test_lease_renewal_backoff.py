"""A lease renewal that fails with a fault the transport does not retry is retried with the runner's
backoff, not in a tight loop: here the coordinator refuses the renewals of a device revoked mid-task."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from fedlink.common.dxo import DXO
from fedlink.common.errors import Unauthenticated
from fedlink.runner.config import ResolverRegistry
from fedlink.runner.context import Context, Signal
from fedlink.runner.loop import Runner
from fedlink.runner.transport.backoff import Backoff
from fedlink.v1 import control_service_pb2 as cpb

from .conftest import coordinator_settings, serving, transport, zero_softmax_model

#: How long the task goes on after the device is revoked (its renewals fail all that time).
REFUSED_FOR_S = 2.5
BACKOFF = Backoff(base=timedelta(seconds=0.2), cap=timedelta(seconds=0.4))

started = threading.Event()
revoked = threading.Event()


class _Patient:
    """Works until the device has been revoked for REFUSED_FOR_S, then returns the model unchanged."""

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        started.set()
        assert revoked.wait(60), "the device was never revoked"
        end = time.monotonic() + REFUSED_FOR_S
        while time.monotonic() < end:
            abort_signal.check()
            time.sleep(0.01)
        return DXO(kind=dxo.kind, data={k: v.copy() for k, v in dxo.data.items()}, meta={"num_examples": 1})


async def test_refused_renewals_back_off_instead_of_spinning(tmp_path: Path) -> None:
    started.clear()
    revoked.clear()
    # A 0.9 s lease: the first renewal is due 0.3 s into the task, and every later one is refused.
    settings = coordinator_settings(
        tmp_path / "coordinator", lease=timedelta(seconds=0.9), component_types=("Patient",)
    )
    async with serving(settings) as control:
        await control.submit(
            zero_softmax_model(), {"components": [{"type": "Patient", "name": "p"}], "executors": {"*": "@p"}}
        )
        link = transport(control.address, tmp_path / "state")
        runner = Runner(
            "",
            None,
            {},
            {},
            30.0,
            transport=link,
            resolver_registry=ResolverRegistry({"Patient": _Patient}),
            backoff=BACKOFF,
        )
        running = asyncio.create_task(runner.run_async())
        assert await asyncio.to_thread(started.wait, 60), "the task never started"
        await control.stub.RevokeDevice(
            cpb.RevokeDeviceRequest(device_id=link.device_id, request_id=str(uuid.uuid4())),
            metadata=control.metadata,
        )
        revoked.set()
        # The revoked device's next call after the task (its report, then GetTask) is refused too.
        with pytest.raises(Unauthenticated):
            await asyncio.wait_for(running, timeout=60)

    refused = [code for rpc, code in link.failed_attempts if rpc == "RenewLease"]
    assert refused and set(refused) <= {"UNAUTHENTICATED", "PERMISSION_DENIED"}, link.failed_attempts
    # Waits drawn from [0, 0.2 s], then [0, 0.4 s]: about a dozen attempts in 2.5 s. A loop that retried
    # at once made one per round trip, thousands.
    assert 2 <= len(refused) <= 40, f"{len(refused)} refused renewals in {REFUSED_FOR_S}s"
