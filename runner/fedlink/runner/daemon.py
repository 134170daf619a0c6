"""The ``fedlink runner`` daemon: the Runner with the built-ins, a data source from settings, and signals.

SIGTERM or SIGINT stops polling at once; the task in progress gets ``shutdown_grace`` to finish and be
reported, then it is aborted and released, and the process exits 0. A second signal aborts at once.
A result that could not be delivered stays in the state directory and is sent by the next start.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Final

from fedlink.common.errors import FedlinkError
from fedlink.runner.data import NpzDataSource, PartitionedDataSource
from fedlink.runner.loop import Runner
from fedlink.runner.settings import RunnerSettings
from fedlink.runner.spec import DataSource
from fedlink.runner.transport.grpc_transport import GrpcTransport, GrpcTransportConfig

__all__ = ["build_runner", "configure_logging", "run_daemon"]

_log = logging.getLogger(__name__)
#: Exit status when the runner cannot go on (bad settings, a refused credential...): systemd restarts it.
EXIT_FAILURE: Final = 1


def configure_logging(level: str) -> None:
    """One line per record on stderr (journald adds its own timestamps, but plain runs want them)."""
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def build_data_source(settings: RunnerSettings) -> DataSource | None:
    """The data source the settings describe (None without ``data``)."""
    if settings.data is None:
        return None
    source: DataSource = NpzDataSource(settings.data)
    if settings.partition_id is not None:
        source = PartitionedDataSource(
            source,
            num_partitions=settings.num_partitions,
            partition_id=settings.partition_id,
            method="dirichlet" if settings.partition == "dirichlet" else "iid",
            alpha=settings.partition_alpha,
            seed=settings.partition_seed,
        )
    return source


def build_runner(settings: RunnerSettings) -> Runner:
    """A Runner over a GrpcTransport, configured from ``settings``."""
    transport = GrpcTransport(
        GrpcTransportConfig(
            server=settings.server,
            state_dir=settings.state_dir,
            ca_cert=settings.ca_cert,
            insecure=settings.insecure,
            join_secret=settings.join_secret,
            device_info=settings.device_info,
            user_info=settings.user_info,
            task_wait=settings.task_wait,
            per_request=settings.per_request,
        )
    )
    return Runner(
        settings.job_name,
        build_data_source(settings),
        settings.device_info,
        settings.user_info,
        settings.job_timeout_seconds,
        transport=transport,
        partition_id=settings.partition_id,
        num_partitions=settings.num_partitions,
    )


async def _serve(runner: Runner, grace: float) -> None:
    loop = asyncio.get_running_loop()
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        name = signal.Signals(signum).name
        if signals_seen == 1:
            _log.info(f"{name}: stopping; the task in progress has {grace:g}s to finish")
            runner.stop(grace=grace, reason=f"{name}, after the {grace:g}s grace period")
        else:
            _log.info(f"{name} again: aborting now")
            runner.stop(grace=0, reason=f"second {name}")

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await runner.run_async()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)


def run_daemon(settings: RunnerSettings) -> int:
    """Runs until the session is over or a signal stops it; returns the process exit status."""
    try:
        runner = build_runner(settings)
        _log.info(
            "runner starting",
            extra={
                "server": settings.server,
                "state_dir": str(settings.state_dir),
                "job_name": settings.job_name,
            },
        )
        asyncio.run(_serve(runner, settings.shutdown_grace.total_seconds()))
    except FedlinkError as exc:
        _log.error(f"runner stopped: {type(exc).__name__}: {exc}")
        return EXIT_FAILURE
    return 0
