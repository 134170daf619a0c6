"""The coordinator's commands, added to the ``fedlink`` group when the server extra is installed."""

from __future__ import annotations

import importlib

import click


def server_commands() -> list[click.Command]:
    """Returns the server-side commands that exist so far (only ``db`` for now).

    Commands that are not written yet are left out, rather than listed as stubs that pretend to work.
    """
    commands: list[click.Command] = []
    try:
        # Imported by name until fedlink.server.cli.db lands, so the CLI works without it meanwhile.
        db = importlib.import_module("fedlink.server.cli.db")
    except ModuleNotFoundError as exc:
        if exc.name != "fedlink.server.cli.db":
            raise
    else:
        db_group: click.Command = db.db_group
        commands.append(db_group)
    return commands
