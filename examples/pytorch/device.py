"""One device of the PyTorch example: what ``fedlink runner`` does, plus the example's trainer type.

``fedlink runner`` knows only the built-in component types, so it cannot build the job's
``digits_cnn:DigitsCNNTrainer``; this script is ``fedlink runner`` with :func:`digits_cnn.registry`
given to the Runner. It takes the same settings (the flags below, a ``--config`` TOML, ``FEDLINK_*``
variables) through :func:`fedlink.runner.settings.load_runner_settings`, and stops the same way on
SIGTERM or SIGINT (the task in progress gets ``--shutdown-grace``). For example::

    python examples/pytorch/device.py --server 127.0.0.1:50051 --insecure --state-dir dev-0 \\
        --data digits.npz --partition-id 0 --num-partitions 4 --partition dirichlet

Once job_data types can be loaded by import path, ``PYTHONPATH=examples/pytorch fedlink runner ...``
with the modules it may load allowed replaces this script, and the job file stays as it is.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from fedlink.common.errors import FedlinkError
from fedlink.runner.daemon import EXIT_FAILURE, build_runner, configure_logging
from fedlink.runner.settings import load_runner_settings

if TYPE_CHECKING:  # mypy checks the tree from its root; run as a script, this folder is on sys.path
    from examples.pytorch.digits_cnn import registry
else:
    from digits_cnn import registry

log = logging.getLogger("device")

#: The ``fedlink runner`` settings this script takes as flags (``--job-name`` for ``job_name``...).
SETTINGS = (
    "server",
    "ca_cert",
    "insecure",
    "join_secret_file",
    "state_dir",
    "job_name",
    "data",
    "partition_id",
    "num_partitions",
    "partition",
    "partition_alpha",
    "partition_seed",
    "job_timeout",
    "task_wait",
    "per_request",
    "shutdown_grace",
    "log_level",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the settings above, ``--device-info K=V`` (repeatable) and ``--config``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name in SETTINGS:
        flag = "--" + name.replace("_", "-")
        if name == "insecure":
            parser.add_argument(flag, action="store_true", default=None, help="plaintext gRPC (tests only)")
        else:
            parser.add_argument(flag, dest=name, help=f"as for fedlink runner {flag}")
    parser.add_argument("--device-info", action="append", metavar="K=V", help="describes the device")
    parser.add_argument("--config", type=Path, help="a runner.toml, as for fedlink runner --config")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Runs the device until the session ends or a signal stops it; returns the exit status."""
    args = parse_args(argv)
    flags = {name: getattr(args, name) for name in (*SETTINGS, "device_info")}
    try:
        settings = load_runner_settings(args.config, flags=flags)
    except FedlinkError as exc:
        print(f"device.py: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    try:
        runner = build_runner(settings)
    except FedlinkError as exc:
        log.error(f"cannot start: {exc}")
        return EXIT_FAILURE
    # The one thing fedlink runner cannot do yet: the app's component types (see the module doc).
    runner.resolver_registry = registry()
    grace = settings.shutdown_grace.total_seconds()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        runner.stop(grace=grace, reason=f"{signal.Signals(signum).name}, after the {grace:g}s grace period")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        runner.run()
    except FedlinkError as exc:
        log.error(f"runner stopped: {type(exc).__name__}: {exc}")
        return EXIT_FAILURE
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
