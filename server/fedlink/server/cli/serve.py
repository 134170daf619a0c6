"""``fedlink serve``: run the coordinator until SIGTERM or SIGINT, then stop gracefully and exit 0.

Its options are generated from :class:`~fedlink.server.settings.CoordinatorSettings` and the field
docstrings, so ``--help`` documents every setting and cannot drift from them. Only options given on
the command line are passed to :func:`~fedlink.server.settings.load_settings`, which applies the
precedence defaults < ``--config`` TOML file < ``FEDLINK_*`` environment < flags.

Exit codes: 0 after a graceful stop; 2 for a bad setting (named with where it came from), a secret file
named by ``--join-secret-file`` or ``--admin-token-file`` included; 1 when the coordinator cannot start
(address in use, database unreachable, the data directory in use by another coordinator, an unusable
secret file of the data directory's own).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import typing
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import click
from click.core import ParameterSource

from fedlink.common.errors import FedlinkError, InvalidArgument
from fedlink.server.cli.client import CommandError
from fedlink.server.gc_tuning import GC_CONTROL
from fedlink.server.settings import CoordinatorSettings, env_var, load_settings, setting_docs

if TYPE_CHECKING:
    from fedlink.server.app import Coordinator

log = logging.getLogger(__name__)

#: Extra, shorter spellings of some settings' flags (the issue's names).
ALIASES: Final[dict[str, tuple[str, ...]]] = {"db_url": ("--db",)}
EXIT_START_FAILED: Final = 1
#: The coordinator stopped by itself: a background loop did not recover (see loop_failure_timeout).
EXIT_SERVE_FAILED: Final = 3


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _format_default(value: object) -> str | None:
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
        for unit, size in (("h", 3600), ("m", 60), ("s", 1)):
            if seconds >= size and seconds % size == 0:
                return f"{int(seconds // size)}{unit}"
        return f"{seconds}s"
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1024 and value % 1024 == 0:
        for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
            if value % size == 0:
                return f"{value // size}{unit}"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    if value is None or value == "" or isinstance(value, bool):
        return None
    return str(value)


def _metavar(name: str, hint: object) -> str:
    if hint is timedelta:
        return "DURATION"
    if name.endswith("_bytes"):
        return "SIZE"
    if name.endswith("_address"):
        return "HOST:PORT"
    if hint is int:
        return "N"
    if name.endswith("_url"):
        return "URL"
    if Path in typing.get_args(hint) or hint is Path:
        return "PATH"
    return "TEXT"


def _setting_option(field: dataclasses.Field[Any], hint: object) -> click.Option:
    """One ``--kebab-name`` option for a settings field, documented by the field's docstring."""
    name = field.name
    doc = setting_docs().get(name, "").replace("``", "")
    default: object = None
    if field.default is not dataclasses.MISSING and not isinstance(field.default, Path):
        default = field.default
    shown = _format_default(default)
    help_text = f"{doc} [env: {env_var(name)}]" + (f" [default: {shown}]" if shown else "")
    flags = [_flag(name), *ALIASES.get(name, ()), name]
    inner = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
    if hint is bool:
        return click.Option(flags, is_flag=True, default=False, help=help_text)
    if inner is bool:  # optional bool: unset means "derived" (see the docstring)
        return click.Option(
            [f"{flags[0]}/--no-{flags[0][2:]}", name], default=None, is_flag=True, help=help_text
        )
    if typing.get_origin(hint) is Literal:
        choices = [str(c) for c in typing.get_args(hint)]
        return click.Option(flags, type=click.Choice(choices), help=help_text)
    # Everything else is read as text and parsed by load_settings, exactly as the environment is.
    return click.Option(flags, metavar=_metavar(name, inner), help=help_text)


def _serve_params() -> list[click.Parameter]:
    hints = typing.get_type_hints(CoordinatorSettings)
    params: list[click.Parameter] = [
        click.Option(
            ["--config"],
            type=click.Path(dir_okay=False, path_type=Path),
            envvar="FEDLINK_CONFIG",
            help="TOML file of settings (a [serve] table, or top-level keys) [env: FEDLINK_CONFIG].",
        )
    ]
    params.extend(_setting_option(f, hints[f.name]) for f in dataclasses.fields(CoordinatorSettings))
    return params


# ---- running -----------------------------------------------------------------------------------------


def _loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if kind == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if kind == "uvloop":
            raise CommandError("loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None  # auto: plain asyncio is fine, only slower
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _announce(
    settings: CoordinatorSettings, address: str, ca_cert: Path | None, tls_names: tuple[str, ...] = ()
) -> None:
    mode = "plaintext, no TLS (--insecure)" if settings.insecure else "TLS"
    lines = [f"fedlink coordinator listening on {address} ({mode})"]
    if ca_cert is not None:
        lines.append(f"  CA certificate for runners to trust: {ca_cert}")
    if tls_names:
        lines.append(
            f"  its certificate covers: {', '.join(tls_names)} (others: --tls-hostnames; your own "
            "certificate: --tls-cert/--tls-key)"
        )
    if settings.admin_token:
        lines.append("  admin token: as configured (admin_token setting)")
    elif settings.generates_admin_token:
        lines.append(f"  admin token: {settings.admin_token_file} (fedlink job/device read it from there)")
    else:
        lines.append(
            f"  admin token: {settings.admin_token_file} (fedlink job/device: --admin-token-file "
            f"{settings.admin_token_file})"
        )
    if settings.open_enrolment:
        lines.append("  enrolment: open, no join secret needed")
    elif settings.join_secret:
        lines.append("  join secret: as configured (join_secret setting)")
    else:
        lines.append(f"  join secret for runners: {settings.join_secret_file}")
    lines.append(f"  database: {settings.redacted_db_url}")
    if settings.metrics_address:
        lines.append(f"  metrics: http://{settings.metrics_address}/metrics")
    for line in lines:
        click.echo(line)


class ServeFailed(CommandError):
    """The coordinator stopped by itself: a background loop could not recover (exit 3)."""

    exit_code = EXIT_SERVE_FAILED


class StartFailed(CommandError):
    """The coordinator could not start (address in use, database unreachable, ...): exit 1."""

    exit_code = EXIT_START_FAILED


def _start_failure(settings: CoordinatorSettings, exc: BaseException) -> CommandError:
    if isinstance(exc, InvalidArgument):
        return CommandError(exc.message)  # a bad setting discovered at start (e.g. a TLS file): exit 2
    if isinstance(exc, FedlinkError):
        return StartFailed(f"cannot start the coordinator: {exc.message}")
    if isinstance(exc, RuntimeError | OSError) and (
        "bind" in str(exc).lower() or "listen" in str(exc).lower()
    ):
        return StartFailed(
            f"cannot listen on {settings.listen_address}: the address is in use or not available on "
            "this host (choose another with --listen-address)"
        )
    return StartFailed(f"cannot start the coordinator: {type(exc).__name__}: {exc}")


async def run_coordinator(settings: CoordinatorSettings) -> None:
    """Runs the coordinator until SIGTERM/SIGINT (or until it stops), then stops it gracefully.

    Raises:
        CommandError: the coordinator could not start.
    """
    from fedlink.server.app import Coordinator  # the whole server stack: only when serving

    coordinator = Coordinator(settings)
    try:
        await coordinator.start()
    except Exception as exc:
        log.debug("start failed", exc_info=True)
        await coordinator.stop(grace=0)
        raise _start_failure(settings, exc) from None
    assert coordinator.endpoint is not None  # set by start()
    _announce(
        settings, coordinator.endpoint.address, coordinator.endpoint.ca_cert, coordinator.endpoint.tls_names
    )
    with GC_CONTROL.quiet():
        GC_CONTROL.settle()  # what serving needs is loaded now: later collections skip it
        await _serve_until_stopped(settings, coordinator)
    if coordinator.failure is not None:
        raise ServeFailed(f"the coordinator stopped: {coordinator.failure}")


async def _serve_until_stopped(settings: CoordinatorSettings, coordinator: Coordinator) -> None:
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    handled: list[signal.Signals] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):  # no add_signal_handler on Windows
            loop.add_signal_handler(sig, stop_requested.set)
            handled.append(sig)
    waiters = [
        asyncio.create_task(stop_requested.wait(), name="stop-requested"),
        asyncio.create_task(coordinator.wait_closed(), name="coordinator-closed"),
    ]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        grace = settings.shutdown_grace.total_seconds()
        click.echo(f"stopping: finishing in-flight calls (up to {grace:g}s)")
        await coordinator.stop()
        click.echo("stopped")
    finally:
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        for sig in handled:
            loop.remove_signal_handler(sig)


@click.pass_context
def _serve(ctx: click.Context, /, config: Path | None, **values: object) -> None:
    from fedlink.server.logs import configure_logging

    # Only flags typed on the command line override; the rest comes from the file and environment.
    given = {
        name: value
        for name, value in values.items()
        if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
    }
    try:
        settings = load_settings(config_file=config, environ=os.environ, overrides=given)
    except FedlinkError as exc:
        raise CommandError(exc.message) from None
    configure_logging(settings.log_format, settings.log_level)
    with asyncio.Runner(loop_factory=_loop_factory(settings.loop)) as runner:
        runner.run(run_coordinator(settings))


serve_command = click.Command(
    "serve",
    callback=_serve,
    params=_serve_params(),
    help=(
        "Run the coordinator: the device and control gRPC services, health, reflection and metrics.\n\n"
        "Settings come from defaults < --config TOML < FEDLINK_* environment < flags. With no flags it "
        "serves TLS with a self-signed CA on 127.0.0.1:8443 and keeps everything in the data directory, "
        "owner-only (files 0600, directories 0700), which one coordinator at a time may use (a second "
        "one exits 1 naming the first). Give secrets as files (--join-secret-file, --admin-token-file): "
        "the values of --join-secret and --admin-token are visible to every local user in the process "
        "list. SIGTERM or SIGINT stops it gracefully (exit 0). If a background loop (the job supervisor, "
        "maintenance, collection, metrics) keeps failing past loop_failure_timeout, health turns NOT_SERVING "
        "and it stops with exit 3."
    ),
    short_help="Run the coordinator.",
    context_settings={"max_content_width": 110},
)


__all__ = ["ALIASES", "run_coordinator", "serve_command"]
