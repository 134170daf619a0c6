"""bench.proc_stats.CpuTrace: the CPU a process spent within a window timed on perf_counter."""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    # bench/ holds scripts run from the repository root (python -m bench.X), not an installed package.
    sys.path.insert(0, str(ROOT))
proc_stats = importlib.import_module("bench.proc_stats")


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


async def test_cpu_within_a_window_is_what_was_burnt_there_not_around_it() -> None:
    async with proc_stats.CpuTrace(os.getpid(), interval_s=0.01) as trace:
        await asyncio.sleep(0.05)
        _burn(0.2)  # before the window: not counted
        await asyncio.sleep(0.05)
        start = time.perf_counter()
        _burn(0.3)  # blocks the loop: the trace has no sample inside; interpolation must span it
        await asyncio.sleep(0.05)
        idle_from = time.perf_counter()
        await asyncio.sleep(0.3)
        end = time.perf_counter()
        await asyncio.sleep(0.05)
    burnt = trace.between(start, idle_from)
    assert 0.25 <= burnt <= 0.4, burnt
    assert trace.between(idle_from, end) <= 0.1  # the event loop alone, sleeping
    assert 0.25 <= trace.between(start, end) <= 0.5


def test_a_trace_that_never_ran_refuses_to_answer() -> None:
    with pytest.raises(ValueError, match="no samples"):
        proc_stats.CpuTrace(os.getpid()).between(0.0, 1.0)
