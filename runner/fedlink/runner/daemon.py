"""The ``fedlink runner`` daemon: the Runner with the built-ins, a data source from settings, and signals.

SIGTERM or SIGINT stops polling at once; the task in progress gets ``shutdown_grace`` to finish and be
reported, then it is aborted and released, and the process exits 0. A second signal aborts at once.
A result that could not be delivered stays in the state directory and is sent by the next start.

Exit status: 0 when the session is over or a signal stopped it; 1 when the runner cannot go on (the
coordinator unreachable for ``connect_timeout``, a refused credential...), which systemd restarts; 2
when it cannot start at all (a CA file that is missing or not PEM): fix the settings first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Final

from fedlink.common import logs
from fedlink.common.errors import FedlinkError
from fedlink.runner.data import DeviceData
from fedlink.runner.loop import Runner
from fedlink.runner.settings import RunnerSettings
from fedlink.runner.spec import DataSource
from fedlink.runner.transport.grpc_transport import GrpcTransport, GrpcTransportConfig

__all__ = ["build_runner", "configure_logging", "run_daemon"]

_log = logging.getLogger(__name__)
#: Exit status when the runner cannot go on (unreachable, a refused credential...): systemd restarts it.
EXIT_FAILURE: Final = 1
#: Exit status when the runner cannot start with these settings (a CA file that is not PEM...).
EXIT_CONFIG: Final = 2


def configure_logging(level: str, format: str = "console") -> logging.Handler:
    """One line per record on stderr: readable (``console``) or a JSON object (``json``).

    The format is the coordinator's (:mod:`fedlink.common.logs`): job, task and device ids are fields.
    """
    return logs.configure_logging(format, level)


class _DeviceIdField(logging.Filter):
    """Adds the device id to every record once the device has one (one device per daemon process)."""

    def __init__(self, runner: Runner) -> None:
        super().__init__()
        self._transport = runner.transport

    def filter(self, record: logging.LogRecord) -> bool:
        """Stamps ``device_id`` (unless the record has its own) and lets the record through."""
        if not hasattr(record, "device_id"):
            with contextlib.suppress(FedlinkError):  # not enrolled yet
                record.device_id = self._transport.device_id
        return True


def build_data_source(settings: RunnerSettings) -> DataSource | None:
    """The data source the settings describe (None without ``data``)."""
    if settings.data is None:
        return None
    data = DeviceData(
        path=settings.data,
        partition="dirichlet" if settings.partition == "dirichlet" else "iid",
        alpha=settings.partition_alpha,
        seed=settings.partition_seed,
    )
    if settings.partition_id is None:
        return data.whole()
    return data.partitioned(settings.partition_id, settings.num_partitions)


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
            connect_timeout=settings.connect_timeout,
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
        allow_components=settings.allow_components,
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
    except FedlinkError as exc:
        _log.error(f"runner cannot start: {exc}")
        return EXIT_CONFIG
    device_id = _DeviceIdField(runner)
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(device_id)
    try:
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
    finally:
        for handler in handlers:
            handler.removeFilter(device_id)
    return 0
