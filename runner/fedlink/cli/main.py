"""The ``fedlink`` entry point: a click group whose server commands are imported only when used."""

from __future__ import annotations

from typing import Any

import click

from fedlink.cli.extras import SERVER_COMMAND_NAMES, missing_server_extra_command, server_extra_installed
from fedlink.cli.runner import runner_command
from fedlink.common.version import PROTOCOL_VERSION, __version__


class FedlinkGroup(click.Group):
    """The top-level group; it adds the server's commands on first use, not at import.

    Importing the server commands pulls in SQLAlchemy and friends, so ``fedlink --version`` (handled
    while parsing, before any command is looked up) never pays for them. A runner-only install gets the
    operator's commands (``job``, ``device``: plain gRPC clients) and, for the others, stand-ins that say
    which extra to install.
    """

    def __init__(self, *args: Any, server_extra: bool | None = None, **kwargs: Any) -> None:
        """Creates the group.

        Args:
            *args: Passed to ``click.Group``.
            server_extra: Whether the server extra is installed; ``None`` detects it on first use.
            **kwargs: Passed to ``click.Group``.
        """
        super().__init__(*args, **kwargs)
        self._server_extra = server_extra
        self._server_loaded = False

    def _load_server_commands(self) -> None:
        if self._server_loaded:
            return
        self._server_loaded = True
        installed = server_extra_installed() if self._server_extra is None else self._server_extra
        # Imported here so that the runner side never imports the server package on its own.
        from fedlink.server.cli import operator_commands, server_commands

        if installed:
            for command in server_commands():
                self.add_command(command)
        else:
            for command in operator_commands():
                self.add_command(command)
            for name in SERVER_COMMAND_NAMES:
                self.add_command(missing_server_extra_command(name))

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Lists every command, the server's included."""
        self._load_server_commands()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """Looks a command up by name; the server's commands are loaded only for one of theirs, so that
        ``fedlink runner`` never imports the server side."""
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            return command
        self._load_server_commands()
        return super().get_command(ctx, cmd_name)


def build_cli(*, server_extra: bool | None = None) -> click.Group:
    """Builds the ``fedlink`` group.

    Args:
        server_extra: Whether to treat the server extra as installed; ``None`` (the console script's
            choice) detects it.

    Returns:
        The group, ready to be invoked.
    """

    @click.group(
        "fedlink",
        cls=FedlinkGroup,
        server_extra=server_extra,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    @click.version_option(
        __version__,
        "-V",
        "--version",
        prog_name="fedlink",
        message=f"%(prog)s %(version)s (device protocol {PROTOCOL_VERSION})",
    )
    def fedlink() -> None:
        """fedlink: federated learning between one coordinator and many edge devices."""

    fedlink.add_command(runner_command)
    return fedlink


cli = build_cli()


def main() -> None:
    """Runs the ``fedlink`` command line (the console script)."""
    cli.main(prog_name="fedlink")
