"""The benchmark's child processes: servers that write a ready file, load processes that speak JSON lines."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from bench.orphans import tied

REPO = Path(__file__).resolve().parents[1]


def _stderr_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class ServerProcess:
    """``python -m <module> --ready-file F ...`` in its own process, until the context exits (SIGTERM).

    ``info`` is the JSON object the server wrote to its ready file (at least ``address``).
    """

    def __init__(
        self, module: str, args: list[str], workdir: Path, name: str, start_timeout_s: float = 120
    ) -> None:
        self._module = module
        self._args = args
        self._ready = workdir / f"{name}.ready.json"
        self._stderr = workdir / f"{name}.stderr.log"
        self._timeout = start_timeout_s
        self._process: asyncio.subprocess.Process | None = None
        self.info: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        """The server's process id."""
        assert self._process is not None
        return self._process.pid

    async def __aenter__(self) -> ServerProcess:
        self._ready.unlink(missing_ok=True)
        with self._stderr.open("wb") as stderr:
            self._process = await asyncio.create_subprocess_exec(
                *tied([sys.executable]),
                "-m",
                self._module,
                "--ready-file",
                str(self._ready),
                *self._args,
                cwd=REPO,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=stderr,
            )
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._timeout
        while not self._ready.exists():
            if self._process.returncode is not None or loop.time() > give_up:
                await self._terminate()
                raise RuntimeError(f"{self._module} did not start:\n{_stderr_tail(self._stderr)}")
            await asyncio.sleep(0.05)
        self.info = json.loads(self._ready.read_text())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._terminate()

    async def _terminate(self) -> None:
        process = self._process
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            process.kill()
            await process.wait()


class LoadProcess:
    """``python -m bench.device_load '<spec>'``: reads its JSON-line events, writes lines to its stdin."""

    def __init__(self, spec: dict[str, Any], workdir: Path, name: str) -> None:
        self._spec = spec
        self._stderr = workdir / f"{name}.stderr.log"
        self._process: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        """The load process's id."""
        assert self._process is not None
        return self._process.pid

    async def __aenter__(self) -> LoadProcess:
        with self._stderr.open("wb") as stderr:
            self._process = await asyncio.create_subprocess_exec(
                *tied([sys.executable]),
                "-m",
                "bench.device_load",
                json.dumps(self._spec),
                cwd=REPO,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                limit=16 * 1024**2,
            )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        process = self._process
        if process is not None and process.returncode is None:
            process.kill()
            await process.wait()

    async def event(self, name: str, timeout_s: float) -> dict[str, Any]:
        """Waits for the next event line, which must be ``name``."""
        assert self._process is not None and self._process.stdout is not None
        try:
            line = await asyncio.wait_for(self._process.stdout.readline(), timeout_s)
        except TimeoutError:
            raise RuntimeError(f"no {name!r} from the load process within {timeout_s:.0f}s") from None
        if not line:
            await self._process.wait()
            raise RuntimeError(
                f"the load process exited ({self._process.returncode}) before {name!r}:\n"
                + _stderr_tail(self._stderr)
            )
        event: dict[str, Any] = json.loads(line)
        if event.get("event") != name:
            raise RuntimeError(f"expected {name!r} from the load process, got {event.get('event')!r}")
        return event

    def send(self, line: str) -> None:
        """Writes one line to the load process's stdin."""
        assert self._process is not None and self._process.stdin is not None
        self._process.stdin.write(line.encode() + b"\n")


def raise_open_files_limit(wanted: int) -> int:
    """Raises this process's soft RLIMIT_NOFILE (children inherit it) towards ``wanted``; returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(max(soft, wanted), hard) if hard != resource.RLIM_INFINITY else max(soft, wanted)
    if target != soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def cpu_count() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


class Profiler:
    """``py-spy record`` of a process while the context is open: a flame graph and collapsed stacks.

    Does nothing when ``out_dir`` is None. py-spy samples from outside, at 100 Hz, and costs the
    profiled process little; the figures of a profiled run are still not the ones to quote.
    """

    def __init__(self, out_dir: Path | None, pid: int, name: str) -> None:
        self._out_dir = out_dir
        self._pid = pid
        self._name = name
        self._processes: list[asyncio.subprocess.Process] = []

    async def __aenter__(self) -> Profiler:
        if self._out_dir is None:
            return self
        self._out_dir.mkdir(parents=True, exist_ok=True)
        py_spy = Path(sys.executable).with_name("py-spy")
        for fmt, suffix in (("flamegraph", "svg"), ("raw", "txt")):
            self._processes.append(
                await asyncio.create_subprocess_exec(
                    *tied([str(py_spy)]),
                    "record",
                    "--pid",
                    str(self._pid),
                    "--rate",
                    "100",
                    "--format",
                    fmt,
                    "--output",
                    str(self._out_dir / f"{self._name}.{suffix}"),
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
            )
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for process in self._processes:
            if process.returncode is None:
                process.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for process in self._processes:
            await process.wait()
