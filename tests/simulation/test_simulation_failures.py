"""Executor exceptions become failed results; workflow failures and time-outs are raised, never hangs."""

from __future__ import annotations

import asyncio
import gc
import threading
import time

import numpy as np
import pytest

from fedlink.simulation import SimulationError, run_simulation, run_simulation_async

from .conftest import FailOnPartitions, Stalls, WritesIntoModel, job_with


def test_an_executor_exception_is_a_failed_result_with_its_cause() -> None:
    result = run_simulation(job_with(num_rounds=2, min_results=3), 5, runner=FailOnPartitions({1, 3}))
    causes = {(f.device, f.round): f.cause for f in result.failures}
    assert set(causes) == {(1, 1), (3, 1), (1, 2), (3, 2)}
    assert causes[(3, 2)] == "RuntimeError: sensor 3 unplugged"
    assert all(f.task_name == "train" for f in result.failures)
    assert result.participation[1] == () and result.participation[0] == (1, 2)
    assert "failed tasks: 4" in result.summary() and "sensor 1 unplugged" in result.summary()


def test_the_shared_model_is_read_only_so_a_writing_executor_fails_alone() -> None:
    result = run_simulation(job_with(min_results=1), 2, runner=WritesIntoModel(), timeout=20)
    (failure,) = result.failures
    assert failure.device == 0 and "read-only" in failure.cause
    # Device 1 trained on the untouched model: only its step (0.02) is in the average.
    np.testing.assert_array_equal(result.arrays["w"], np.full(4, 0.02, np.float32))


def test_a_workflow_failure_is_raised_with_the_jobs_message_not_a_hang() -> None:
    started = time.monotonic()
    with pytest.raises(SimulationError, match=r"FAILED: round 1 got 0 of the 3 results") as caught:
        run_simulation(
            job_with(round_failure_policy="fail"), 3, runner=FailOnPartitions({0, 1, 2}), timeout=30
        )
    assert caught.value.job_state == "FAILED" and caught.value.rounds_done == 0
    # The devices' own reasons, counted, most common first (ties: the first seen).
    message = str(caught.value)
    assert message.endswith(
        "the 3 results it needs; 3 failed: "
        + ", ".join(
            sorted((f'"RuntimeError: sensor {i} unplugged" (1)' for i in range(3)), key=message.index)
        )
    ), message
    assert time.monotonic() - started < 15


def test_a_simulation_that_cannot_finish_stops_at_its_timeout() -> None:
    stalls = Stalls()
    started = time.monotonic()
    with pytest.raises(SimulationError, match="did not finish within its timeout of 2s"):
        run_simulation(job_with(), 2, runner=stalls, timeout=2)
    assert time.monotonic() - started < 15
    assert stalls.aborted == 2  # the running tasks were told to stop, not left behind


async def test_cancelling_the_simulation_stops_its_devices_and_core(caplog: pytest.LogCaptureFixture) -> None:
    stalls = Stalls()
    running = asyncio.create_task(
        run_simulation_async(job_with(), 3, runner=stalls, timeout=60, backend_config={"num_cpus": 3})
    )
    assert await asyncio.to_thread(stalls.wait_started, 3, 20.0)
    running.cancel()  # what Ctrl-C does to the simulation's main task
    with pytest.raises(asyncio.CancelledError):
        await running
    assert stalls.aborted == 3
    assert not [t for t in threading.enumerate() if t.name == "fedlink-simulation"]
    # The simulation's own CancelledError was taken care of, not left in a future nobody reads.
    await asyncio.sleep(0.05)  # the thread's outcome reaches this loop
    gc.collect()
    assert "exception was never retrieved" not in caplog.text
