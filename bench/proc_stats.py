"""Reads a process's CPU time and memory from /proc (Linux), for the benchmarks' resource figures."""

from __future__ import annotations

import asyncio
import bisect
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class MemoryUse:
    """A process's resident memory now and its peak (VmRSS and VmHWM), in bytes."""

    rss_bytes: int
    peak_bytes: int


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time the process has used so far, in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name may hold spaces and parentheses: the fields we want follow the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / _TICKS_PER_SECOND


def memory_use(pid: int) -> MemoryUse:
    """The process's VmRSS and VmHWM."""
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024  # the kernel reports kB
    return MemoryUse(rss_bytes=values["VmRSS"], peak_bytes=values["VmHWM"])


def reset_peak(pid: int) -> None:
    """Resets the process's VmHWM to its current RSS, so a later peak belongs to what follows."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


async def cpu_percent(pid: int, seconds: float) -> float:
    """The process's CPU use over the next ``seconds``, in percent of one core."""
    loop = asyncio.get_running_loop()
    before, start = cpu_seconds(pid), loop.time()
    await asyncio.sleep(seconds)
    return 100.0 * (cpu_seconds(pid) - before) / (loop.time() - start)


class _Sampler:
    """Calls :meth:`_take` every ``interval_s`` while the context is open, and once more at its end."""

    def __init__(self, pid: int, interval_s: float) -> None:
        self._pid = pid
        self._interval = interval_s
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._take()

    def _take(self) -> None:
        raise NotImplementedError

    async def _sample(self) -> None:
        while True:
            self._take()
            await asyncio.sleep(self._interval)


class RssWatch(_Sampler):
    """Samples a process's RSS every few milliseconds while running, keeping the maximum.

    VmHWM alone cannot tell a phase's peak from an earlier one; sampling also shows the phase's own
    peak even where ``clear_refs`` is not permitted.
    """

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        super().__init__(pid, interval_s)
        self.max_rss_bytes = 0

    def _take(self) -> None:
        self.max_rss_bytes = max(self.max_rss_bytes, memory_use(self._pid).rss_bytes)


class CpuTrace(_Sampler):
    """Samples a process's CPU time every few milliseconds on the ``time.perf_counter`` clock, so the CPU
    it spent within a window another process timed (``perf_counter`` is system-wide monotonic on Linux)
    can be read off afterwards."""

    def __init__(self, pid: int, interval_s: float = 0.05) -> None:
        super().__init__(pid, interval_s)
        self._samples: list[tuple[float, float]] = []

    def _take(self) -> None:
        self._samples.append((time.perf_counter(), cpu_seconds(self._pid)))

    def _at(self, when: float) -> float:
        times = [t for t, _ in self._samples]
        i = bisect.bisect_left(times, when)
        if i == 0:
            return self._samples[0][1]
        if i == len(times):
            return self._samples[-1][1]
        (t0, c0), (t1, c1) = self._samples[i - 1], self._samples[i]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else c1

    def between(self, start: float, end: float) -> float:
        """CPU seconds spent from ``start`` to ``end`` (perf_counter times), interpolated."""
        if not self._samples:
            raise ValueError("no samples: use CpuTrace as a context around the window")
        return self._at(end) - self._at(start)
