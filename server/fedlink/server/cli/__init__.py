"""The coordinator's commands, added to the ``fedlink`` group when the server extra is installed."""

from __future__ import annotations

import click


def server_commands() -> list[click.Command]:
    """Returns the server-side commands: ``serve``, ``job``, ``device``, ``db``, ``simulate``, ``health``.

    Commands that are not written yet are left out, rather than listed as stubs that pretend to work.
    """
    from fedlink.server.cli.db import db_group
    from fedlink.server.cli.devices import device_group
    from fedlink.server.cli.health import health_command
    from fedlink.server.cli.jobs import job_group
    from fedlink.server.cli.serve import serve_command
    from fedlink.server.cli.simulate import simulate_command

    return [serve_command, job_group, device_group, db_group, simulate_command, health_command]


def operator_commands() -> list[click.Command]:
    """Returns the operator's commands, ``job``, ``device`` and ``health``: gRPC clients of a running
    coordinator, which need none of the server extra (a runner-only install has them too)."""
    from fedlink.server.cli.devices import device_group
    from fedlink.server.cli.health import health_command
    from fedlink.server.cli.jobs import job_group

    return [job_group, device_group, health_command]
