"""Which optional extras are installed, and the commands that stand in for a missing server extra."""

from __future__ import annotations

from importlib.util import find_spec

import click

#: Top-level commands that run the coordinator side and so need ``pip install 'fedlink[server]'``.
SERVER_COMMAND_NAMES = ("serve", "db", "simulate")
#: The operator's commands: gRPC clients of a running coordinator, available in every install.
OPERATOR_COMMAND_NAMES = ("job", "device", "health")

# Modules of the server extra that the server commands cannot start without.
_SERVER_EXTRA_MODULES = ("sqlalchemy", "alembic")

#: Exit code for "this install cannot run that command": click's code for usage errors.
MISSING_EXTRA_EXIT_CODE = 2


class MissingExtraError(click.ClickException):
    """A command needs an optional extra that is not installed."""

    exit_code = MISSING_EXTRA_EXIT_CODE


def server_extra_installed() -> bool:
    """Tells whether the server extra is installed, without importing any of it.

    ``find_spec`` only locates the top-level modules, so ``fedlink --help`` on a device stays fast.
    """
    return all(find_spec(name) is not None for name in _SERVER_EXTRA_MODULES)


def missing_server_extra_command(name: str) -> click.Command:
    """Builds a command that only explains how to install the server extra, then exits with code 2.

    It takes any arguments and options, so ``fedlink db upgrade --url x`` gets the same clear message
    rather than a parse error about an option the stand-in does not know.
    """

    def explain(args: tuple[str, ...]) -> None:
        del args  # The real command would parse them; without the extra they do not matter.
        raise MissingExtraError(f"fedlink {name} needs the server extra: pip install 'fedlink[server]'")

    return click.Command(
        name,
        callback=explain,
        params=[click.Argument(["args"], nargs=-1, type=click.UNPROCESSED)],
        help="Not available in this install: needs the server extra (pip install 'fedlink[server]').",
        short_help="Needs the server extra: pip install 'fedlink[server]'.",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
        add_help_option=False,
    )
