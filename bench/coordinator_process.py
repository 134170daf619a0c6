"""Runs a fedlink Coordinator in a process of its own on uvloop, for the benchmarks.

``python -m bench.coordinator_process --ready-file F --settings JSON`` builds ``CoordinatorSettings``
from the JSON object (durations in seconds), serves until SIGTERM, and writes
``{"address", "admin_token", "pid"}`` to F once it listens. It stands in for ``fedlink serve`` with
``--insecure --open-enrolment``, with the settings the benchmark needs and nothing read from the
environment.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import uvloop

from fedlink.server.app import Coordinator
from fedlink.server.gc_tuning import GC_CONTROL
from fedlink.server.settings import CoordinatorSettings

_DURATIONS = frozenset(
    {"max_task_wait", "default_task_wait", "lease", "device_offline_after", "shutdown_grace"}
)


def settings_from_json(values: dict[str, Any]) -> CoordinatorSettings:
    """CoordinatorSettings from plain JSON values: seconds for durations, strings for paths."""
    converted: dict[str, Any] = {}
    for key, value in values.items():
        if key in _DURATIONS:
            converted[key] = timedelta(seconds=float(value))
        elif key in ("data_dir", "blob_dir"):
            converted[key] = Path(value)
        else:
            converted[key] = value
    return CoordinatorSettings(insecure=True, open_enrolment=True, listen_address="127.0.0.1:0", **converted)


async def serve(settings: CoordinatorSettings, ready_file: Path) -> None:
    """Runs the coordinator until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with Coordinator(settings) as coordinator:
        assert coordinator.endpoint is not None
        ready = {
            "address": coordinator.endpoint.address,
            "admin_token": coordinator.admin_token,
            "pid": os.getpid(),
        }
        partial = ready_file.with_suffix(".tmp")
        partial.write_text(json.dumps(ready))
        partial.rename(ready_file)
        with GC_CONTROL.quiet():  # as `fedlink serve` does once it serves
            GC_CONTROL.settle()
            await stop.wait()
        await coordinator.stop(grace=1.0)


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ready-file", type=Path, required=True)
    parser.add_argument("--settings", required=True, help="JSON object of CoordinatorSettings fields")
    args = parser.parse_args(argv)
    uvloop.run(serve(settings_from_json(json.loads(args.settings)), args.ready_file))


if __name__ == "__main__":
    main()
