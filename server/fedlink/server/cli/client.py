"""How the operator commands reach the coordinator: flags and environment to an authenticated channel.

Every ``fedlink job …`` and ``fedlink device …`` command takes the same connection options. The
environment variables are the coordinator's own where they mean the same thing, so one shell set up
for ``fedlink serve`` (``FEDLINK_DATA_DIR``, ``FEDLINK_INSECURE``, ``FEDLINK_ADMIN_TOKEN_FILE``,
``FEDLINK_ADMIN_TOKEN``) also works for the operator commands; ``FEDLINK_SERVER`` is the client's alone.

Defaults are chosen so that, on the coordinator's host, no option is needed: TLS trusting the
self-signed CA in ``<data_dir>/tls/ca.pem`` and the admin token from ``<data_dir>/admin-token``.

Exit codes: 1 when the coordinator refused or failed a call (``error: NOT_FOUND: …``), 2 when the
command itself is wrong or cannot be set up (bad file, missing token).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NoReturn, ParamSpec, TypeVar

import click
import grpc

from fedlink.common.errors import FedlinkError, NotFound
from fedlink.server.credentials import read_given_secret_file, read_secret_file
from fedlink.server.settings import ADMIN_TOKEN_FILE, default_data_dir, split_address
from fedlink.v1 import control_service_pb2_grpc

#: Where the coordinator listens unless told otherwise (``fedlink serve``'s default).
DEFAULT_SERVER: Final = "127.0.0.1:8443"
#: Deadline of one unary call; streams (watch, upload, download) have none.
CALL_TIMEOUT_S: Final = 60.0
#: Exit code when the coordinator refused or failed a call.
EXIT_RPC_ERROR: Final = 1
#: Exit code when the command line or a local file is wrong.
EXIT_USAGE: Final = 2

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class CommandError(click.ClickException):
    """A problem on this side of the wire (bad option, missing file): ``error: …`` and exit 2."""

    exit_code = EXIT_USAGE

    def show(self, file: Any = None) -> None:
        """Prints ``error: <message>`` to standard error."""
        click.echo(f"error: {self.format_message()}", err=True)


class RpcFailed(click.ClickException):
    """The coordinator answered a call with an error status: ``error: <CODE>: <details>``, exit 1."""

    exit_code = EXIT_RPC_ERROR

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code

    def show(self, file: Any = None) -> None:
        """Prints ``error: <CODE>: <details>`` to standard error."""
        click.echo(f"error: {self.format_message()}", err=True)


def rpc_failed(error: grpc.RpcError) -> RpcFailed:
    """The CLI error for a failed call (sync gRPC errors are also ``grpc.Call``)."""
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
    return RpcFailed(code, details)


def fail(message: str) -> NoReturn:
    """Stops the command with ``error: <message>`` and exit code 2."""
    raise CommandError(message)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionOptions:
    """Where the coordinator is and how to authenticate to it, as given on the command line."""

    server: str
    data_dir: Path
    ca_cert: Path | None
    insecure: bool
    admin_token: str | None
    admin_token_file: Path | None = None

    def resolved_ca_cert(self) -> Path | None:
        """The CA to trust: ``--ca-cert``, else ``<data_dir>/tls/ca.pem`` if it exists, else system roots."""
        if self.ca_cert is not None:
            return self.ca_cert
        default = self.data_dir / "tls" / "ca.pem"
        return default if default.is_file() else None

    def resolved_admin_token(self) -> str:
        """The admin credential: ``--admin-token``, ``--admin-token-file`` (or their variables), else
        ``<data_dir>/admin-token``."""
        if self.admin_token and self.admin_token_file is not None:
            fail("--admin-token and --admin-token-file exclude each other (or their variables): give one")
        if self.admin_token:
            return self.admin_token
        try:
            if self.admin_token_file is not None:
                return read_given_secret_file(self.admin_token_file.expanduser())
            path = self.data_dir / ADMIN_TOKEN_FILE
            try:
                return read_secret_file(path)
            except NotFound:
                fail(
                    f"no admin token: {path} does not exist (the coordinator writes it in its data "
                    "directory on first start; see --data-dir); or pass --admin-token-file"
                )
        except FedlinkError as exc:
            fail(f"--admin-token-file: {exc.message}" if self.admin_token_file else exc.message)

    def channel(self) -> grpc.Channel:
        """Opens a channel to the coordinator (TLS unless ``--insecure``)."""
        try:
            split_address(self.server, what="--server")
        except FedlinkError as exc:
            fail(exc.message)
        options = [("grpc.max_receive_message_length", 64 * 1024**2)]
        if self.insecure:
            return grpc.insecure_channel(self.server, options=options)
        ca = self.resolved_ca_cert()
        if ca is None:
            credentials = grpc.ssl_channel_credentials()  # the system's trusted roots
        else:
            # The runner's check of a CA file (the standard library's ssl, not cryptography): the
            # operator's commands run without the server extra.
            from fedlink.runner.transport.connection import read_ca_file

            try:
                credentials = grpc.ssl_channel_credentials(root_certificates=read_ca_file(ca))
            except FedlinkError as exc:
                fail(exc.message)
        return grpc.secure_channel(self.server, credentials, options=options)


@dataclass(slots=True)
class ControlClient:
    """An open channel to the coordinator's ControlService, with the admin credential to send."""

    stub: control_service_pb2_grpc.ControlServiceStub
    metadata: tuple[tuple[str, str], ...]


@contextmanager
def control_client(options: ConnectionOptions) -> Iterator[ControlClient]:
    """Connects to the ControlService; any gRPC error inside the block becomes ``error: CODE: …``."""
    token = options.resolved_admin_token()
    with options.channel() as channel:
        try:
            yield ControlClient(
                stub=control_service_pb2_grpc.ControlServiceStub(channel),
                metadata=(("authorization", f"Bearer {token}"),),
            )
        except grpc.RpcError as exc:
            raise rpc_failed(exc) from None


#: ``--server``: where the coordinator is (every command that connects to one).
SERVER_OPTION: Final = click.option(
    "--server",
    envvar="FEDLINK_SERVER",
    default=DEFAULT_SERVER,
    show_default=True,
    metavar="HOST:PORT",
    help="The coordinator's address [env: FEDLINK_SERVER].",
)
#: ``--ca-cert``: the CA to trust instead of the data directory's.
CA_CERT_OPTION: Final = click.option(
    "--ca-cert",
    type=click.Path(dir_okay=False, path_type=Path),
    help="PEM CA certificate to trust (default: <data-dir>/tls/ca.pem if it exists, else system roots).",
)
#: ``--insecure``: plaintext, for a coordinator run with ``--insecure``.
INSECURE_OPTION: Final = click.option(
    "--insecure",
    is_flag=True,
    envvar="FEDLINK_INSECURE",
    help="Connect without TLS (for a coordinator run with --insecure) [env: FEDLINK_INSECURE].",
)


def connection_options(command: Callable[P, R]) -> Callable[..., R]:
    """Adds ``--server``, ``--ca-cert``, ``--insecure``, ``--admin-token``, ``--admin-token-file`` and
    ``--data-dir`` to a command.

    The wrapped function receives a :class:`ConnectionOptions` as its ``connection`` argument.
    """

    @SERVER_OPTION
    @CA_CERT_OPTION
    @INSECURE_OPTION
    @click.option(
        "--admin-token",
        envvar="FEDLINK_ADMIN_TOKEN",
        show_envvar=False,
        metavar="TOKEN",
        help=(
            "The admin credential (default: read <data-dir>/admin-token); visible to every local user in "
            "the process list: prefer --admin-token-file [env: FEDLINK_ADMIN_TOKEN]."
        ),
    )
    @click.option(
        "--admin-token-file",
        envvar="FEDLINK_ADMIN_TOKEN_FILE",
        show_envvar=False,
        type=click.Path(dir_okay=False, path_type=Path),
        help=(
            "File holding the admin credential; refused if others may read it "
            "(default: <data-dir>/admin-token) [env: FEDLINK_ADMIN_TOKEN_FILE]."
        ),
    )
    @click.option(
        "--data-dir",
        envvar="FEDLINK_DATA_DIR",
        type=click.Path(file_okay=False, path_type=Path),
        help="The coordinator's data directory, for its CA and admin token [env: FEDLINK_DATA_DIR].",
    )
    @functools.wraps(command)
    def wrapper(
        *args: Any,
        server: str,
        ca_cert: Path | None,
        insecure: bool,
        admin_token: str | None,
        admin_token_file: Path | None,
        data_dir: Path | None,
        **kwargs: Any,
    ) -> R:
        connection = ConnectionOptions(
            server=server,
            data_dir=(data_dir or default_data_dir()).expanduser(),
            ca_cert=ca_cert,
            insecure=insecure,
            admin_token=admin_token,
            admin_token_file=admin_token_file,
        )
        return command(*args, connection=connection, **kwargs)  # type: ignore[arg-type]

    return wrapper


# ---- output ------------------------------------------------------------------------------------------


def collect_pages(fetch: Callable[[int, str], tuple[Sequence[T], str]], limit: int) -> list[T]:
    """Up to ``limit`` items of a paged listing: ``fetch(page_size, page_token)`` gives a page's items
    and the next token ("" after the last page)."""
    items: list[T] = []
    token = ""
    while len(items) < limit:
        page, token = fetch(min(limit - len(items), 1000), token)
        items.extend(page)
        if not token:
            break
    return items[:limit]


def echo_json(value: object) -> None:
    """Prints a value as indented JSON (what ``--format json`` gives)."""
    click.echo(json.dumps(value, indent=2, sort_keys=True))


def echo_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Prints rows under headers in left-aligned columns; ``(none)`` when there are no rows."""
    if not rows:
        click.echo("(none)")
        return
    widths = [max(len(headers[i]), *(len(row[i]) for row in rows)) for i in range(len(headers))]
    for line in (headers, *rows):
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


def format_option(choices: Sequence[str] = ("table", "json")) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """The ``--format`` option of the read commands."""
    return click.option(
        "--format",
        "output_format",
        type=click.Choice(list(choices)),
        default=choices[0],
        show_default=True,
        help="Output format.",
    )


__all__ = [
    "CALL_TIMEOUT_S",
    "CA_CERT_OPTION",
    "DEFAULT_SERVER",
    "EXIT_RPC_ERROR",
    "EXIT_USAGE",
    "INSECURE_OPTION",
    "SERVER_OPTION",
    "CommandError",
    "ConnectionOptions",
    "ControlClient",
    "RpcFailed",
    "connection_options",
    "control_client",
    "echo_json",
    "echo_table",
    "fail",
    "format_option",
    "rpc_failed",
]
