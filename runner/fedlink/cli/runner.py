"""``fedlink runner``: the edge runner daemon (see :mod:`fedlink.runner.daemon`)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from fedlink.common.errors import InvalidArgument

__all__ = ["runner_command"]


@click.command("runner")
@click.option(
    "--server",
    metavar="HOST:PORT[,HOST:PORT...]",
    help="Coordinator host:port; several replicas comma-separated, tried in order when one is unreachable "
    "(a DNS name with several A/AAAA records works too).  [env FEDLINK_SERVER]",
)
@click.option("--ca-cert", type=click.Path(dir_okay=False, path_type=Path), help="PEM CA of the coordinator.")
@click.option("--insecure", is_flag=True, default=None, help="Plaintext gRPC, without TLS (tests only).")
@click.option(
    "--join-secret",
    help="The coordinator's join secret (first enrolment only); visible to every local user in the "
    "process list: prefer --join-secret-file.",
)
@click.option(
    "--join-secret-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="File holding the join secret; refused if others may read it (chmod 600).  "
    "[env FEDLINK_JOIN_SECRET_FILE]",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Identity and pending results; one runner at a time (a second exits 1, naming the first).",
)
@click.option("--job-name", help="Only take jobs with this name.")
@click.option("--data", type=click.Path(dir_okay=False, path_type=Path), help=".npz with x_train/y_train...")
@click.option("--partition-id", type=int, help="Use only this partition of --data.")
@click.option("--num-partitions", type=int, help="How many partitions --data is split into.")
@click.option("--partition", type=click.Choice(["iid", "dirichlet"]), help="How --data is split.")
@click.option("--partition-alpha", type=float, help="Dirichlet concentration (smaller: more skew).")
@click.option("--partition-seed", type=int, help="Seed of the split (the same on every device).")
@click.option(
    "--allow-components",
    multiple=True,
    metavar="PATTERN",
    help="Modules a job's component types (pkg.module:Name) may be imported from, e.g. 'mypkg.*' "
    "(repeatable or comma-separated; none by default: built-in types only).  [env FEDLINK_ALLOW_COMPONENTS]",
)
@click.option("--device-info", multiple=True, metavar="K=V", help="Describes the device (repeatable).")
@click.option("--user-info", multiple=True, metavar="K=V", help="Describes the user (repeatable).")
@click.option("--job-timeout", help="How long to look for a job before exiting (0: for ever).")
@click.option("--task-wait", help="Long-poll wait of one GetTask, e.g. 20s.")
@click.option("--per-request", help="Deadline of other calls, e.g. 30s.")
@click.option(
    "--connect-timeout",
    help="How long the coordinator may stay unreachable before exiting 1 with the cause (default 5m; "
    "0: for ever).",
)
@click.option("--shutdown-grace", help="On SIGTERM, time the current task may take, e.g. 30s.")
@click.option("--log-level", help="DEBUG, INFO, WARNING, ERROR or CRITICAL.")
@click.option(
    "--log-format",
    type=click.Choice(["console", "json"]),
    help="console (readable lines, the default) or json (one object per line, ids as fields).",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A runner.toml; flags and FEDLINK_* variables override it.",
)
def runner_command(config_file: Path | None, **flags: object) -> None:
    """Run the edge runner: take tasks from the coordinator until stopped (SIGTERM: finish, then exit 0).

    Settings come from defaults < --config TOML < FEDLINK_* environment < flags. Exit status: 0 when the
    session is over or a signal stopped it, 1 when it cannot go on (the coordinator unreachable for
    --connect-timeout, a refused credential), 2 for settings it cannot start with (a bad --ca-cert).
    """
    # Imported here so that `fedlink --help` stays fast.
    from fedlink.runner.settings import load_runner_settings

    for name in ("device_info", "user_info", "allow_components"):
        flags[name] = list(flags[name]) if flags[name] else None  # type: ignore[call-overload]
    try:
        settings = load_runner_settings(config_file, flags=flags)
    except InvalidArgument as exc:
        raise click.UsageError(str(exc)) from None
    # gRPC's C core logs every failed handshake on its own, in its own format: the runner says the cause
    # once, in its log (DEBUG keeps gRPC's errors). Read when grpc is first imported, just below.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR" if settings.log_level == "DEBUG" else "NONE")
    from fedlink.runner.transport.addresses import parse_addresses

    try:
        parse_addresses(settings.server, what="--server")  # a bad list is a usage error (exit 2)
    except InvalidArgument as exc:
        raise click.UsageError(str(exc)) from None
    from fedlink.runner.daemon import configure_logging, run_daemon

    configure_logging(settings.log_level, settings.log_format)
    raise SystemExit(run_daemon(settings))
