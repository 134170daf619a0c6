"""How the operator commands reach the coordinator: flags and environment to an authenticated channel.

Every ``fedlink job …`` and ``fedlink device …`` command takes the same connection options. The
environment variables are the coordinator's own where they mean the same thing, so one shell set up
for ``fedlink serve`` (``FEDLINK_DATA_DIR``, ``FEDLINK_INSECURE``, ``FEDLINK_ADMIN_TOKEN_FILE``,
``FEDLINK_ADMIN_TOKEN``) also works for the operator commands; ``FEDLINK_SERVER`` is the client's alone.

Defaults are chosen so that, on the coordinator's host, no option is needed: TLS trusting the
self-signed CA in ``<data_dir>/tls/ca.pem`` and the admin token from ``<data_dir>/admin-token``.

Exit codes: 1 when the coordinator refused or failed a call (``error: NOT_FOUND: …``), 2 when the
command itself is wrong or cannot be set up (bad file, missing token).

``--server`` may list several coordinator replicas, comma-separated (parsed by the runner's
:func:`~fedlink.runner.transport.addresses.parse_addresses`, so both sides read it alike). Each call
goes to the address that answered last (the first one to begin with); a call that fails there with
UNAVAILABLE or DEADLINE_EXCEEDED is made again at the next address, each address once per call; an
error the coordinator answered (NOT_FOUND, PERMISSION_DENIED...) is final. When every address failed,
the error names each one and why: ``error: UNAVAILABLE: no coordinator answered (tried a:8443,
b:8443): a:8443: connection refused…; b:8443: …``. A stream (watch, download) moves only before its
first message; after that, a broken stream marks its address failed and the command's own resume
(``--server`` unchanged) picks the next one. See :class:`FailoverChannel`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, NoReturn, ParamSpec, TypeVar, cast

import click
import grpc

from fedlink.common.errors import FedlinkError, NotFound
from fedlink.runner.transport.addresses import fails_over, parse_addresses
from fedlink.runner.transport.connection import classify
from fedlink.server.credentials import read_given_secret_file, read_secret_file
from fedlink.server.settings import ADMIN_TOKEN_FILE, default_data_dir
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

if TYPE_CHECKING:
    # grpc's multi-callables are generic to type checkers only.
    _UnaryUnaryBase = grpc.UnaryUnaryMultiCallable[Any, Any]
    _UnaryStreamBase = grpc.UnaryStreamMultiCallable[Any, Any]
    _StreamUnaryBase = grpc.StreamUnaryMultiCallable[Any, Any]
else:
    _UnaryUnaryBase = grpc.UnaryUnaryMultiCallable
    _UnaryStreamBase = grpc.UnaryStreamMultiCallable
    _StreamUnaryBase = grpc.StreamUnaryMultiCallable


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
    """The CLI error for a failed call (sync gRPC errors, and :class:`NoCoordinatorAnswered`, are also
    ``grpc.Call``)."""
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
    return RpcFailed(code, details)


def fail(message: str) -> NoReturn:
    """Stops the command with ``error: <message>`` and exit code 2."""
    raise CommandError(message)


def output_file(given: Path | None, default: Path, suffix: str, what: str) -> Path:
    """The file a command writes (``given``, else ``default``): its name ends in ``suffix`` and its
    directory exists, or the command stops (exit 2) saying so; ``what`` says what the file holds."""
    target = given or default
    if target.suffix.lower() != suffix:
        fail(f"{target}: {what} is written as {suffix.lstrip('.').upper()}; name the file *{suffix}")
    if not target.parent.is_dir():
        fail(f"{target}: the directory {target.parent} does not exist")
    return target


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

    def channel(self) -> FailoverChannel:
        """Opens a channel to the coordinator, over every address of ``--server`` (TLS unless
        ``--insecure``)."""
        try:
            addresses = [address.text for address in parse_addresses(self.server, what="--server")]
        except FedlinkError as exc:
            fail(exc.message)
        options = [
            ("grpc.max_receive_message_length", 64 * 1024**2),
            ("grpc.lb_policy_name", "pick_first"),  # a name's A/AAAA records in turn: see addresses.py
        ]
        ca = None if self.insecure else self.resolved_ca_cert()
        if self.insecure:
            return FailoverChannel(
                addresses, lambda target: grpc.insecure_channel(target, options=options), tls=False
            )
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
        return FailoverChannel(
            addresses,
            lambda target: grpc.secure_channel(target, credentials, options=options),
            tls=True,
            ca_file=ca,
        )


class NoCoordinatorAnswered(grpc.RpcError, grpc.Call):
    """A call failed at every address of ``--server`` with UNAVAILABLE or DEADLINE_EXCEEDED.

    A ``grpc.Call`` like the errors it sums up, so that code that reads ``code()`` and ``details()``
    (and resumes a stream after UNAVAILABLE) treats it as it would one of them.
    """

    def __init__(self, failures: Sequence[tuple[str, str, grpc.StatusCode]]) -> None:
        """``failures``: (address, why, code) for every address tried, in the order they were."""
        super().__init__()
        self.failures = tuple(failures)
        codes = {code for _, _, code in self.failures}
        self._code = grpc.StatusCode.UNAVAILABLE if grpc.StatusCode.UNAVAILABLE in codes else codes.pop()
        tried = ", ".join(address for address, _, _ in self.failures)
        causes = "; ".join(f"{address}: {why}" for address, why, _ in self.failures)
        self._details = f"no coordinator answered (tried {tried}): {causes}"

    def __str__(self) -> str:
        return f"{self._code.name}: {self._details}"

    def code(self) -> grpc.StatusCode:
        """UNAVAILABLE if any address said so, else DEADLINE_EXCEEDED."""
        return self._code

    def details(self) -> str:
        """Every address tried, and why it failed."""
        return self._details

    def initial_metadata(self) -> tuple[Any, ...]:
        """None: no coordinator answered."""
        return ()

    def trailing_metadata(self) -> tuple[Any, ...]:
        """None: no coordinator answered."""
        return ()

    def is_active(self) -> bool:
        """Never: the call is over."""
        return False

    def time_remaining(self) -> float:
        """0: the call is over."""
        return 0.0

    def cancel(self) -> bool:
        """Nothing to cancel."""
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Too late: the call is over."""
        return False


def _code(error: grpc.RpcError) -> grpc.StatusCode:
    return error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN


class FailoverChannel(grpc.Channel):
    """A ``grpc.Channel`` over one channel per coordinator address, for the sync generated stubs.

    Calls go to :attr:`address` (the one that answered last; the first to begin with). A unary call
    that fails there with UNAVAILABLE or DEADLINE_EXCEEDED is made at the next address, each address
    once; a streamed response moves the same way until its first message. Once a call has reached a
    coordinator, its errors are the caller's. With one address, its error is raised as gRPC gave it;
    with several, a :class:`NoCoordinatorAnswered` names them all. Not thread-safe.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        make_channel: Callable[[str], grpc.Channel],
        *,
        tls: bool,
        ca_file: Path | None = None,
    ) -> None:
        """Creates a channel per address (gRPC connects on the first call)."""
        self.addresses = tuple(addresses)
        self._channels = [make_channel(address) for address in self.addresses]
        self._tls = tls
        self._ca_file = ca_file
        self._current = 0

    @property
    def address(self) -> str:
        """The address calls go to now: the one that answered last."""
        return self.addresses[self._current]

    def _order(self) -> list[int]:
        count = len(self.addresses)
        return [(self._current + step) % count for step in range(count)]

    def _answered(self, index: int) -> None:
        self._current = index

    def _failed(self, index: int) -> None:
        if index == self._current:
            self._current = (index + 1) % len(self.addresses)

    def _why(self, address: str, error: grpc.RpcError) -> str:
        code = _code(error)
        details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
        failure = classify(code, details, address=address, tls=self._tls, ca_file=self._ca_file)
        return failure.reason if failure is not None else f"{code.name}: {details}"

    def _all_failed(self, failures: list[tuple[int, grpc.RpcError]]) -> grpc.RpcError:
        if len(failures) == 1:
            return failures[0][1]
        return NoCoordinatorAnswered(
            [
                (self.addresses[index], self._why(self.addresses[index], error), _code(error))
                for index, error in failures
            ]
        )

    def call(self, attempt: Callable[[int], T]) -> T:
        """``attempt(index)`` at each address in turn until one does not fail over (see the class).

        Raises:
            grpc.RpcError: the coordinator's own error, or the failure at every address.
        """
        failures: list[tuple[int, grpc.RpcError]] = []
        for index in self._order():
            try:
                result = attempt(index)
            except grpc.RpcError as exc:
                if not fails_over(_code(exc)):
                    self._answered(index)
                    raise
                self._failed(index)
                failures.append((index, exc))
                continue
            self._answered(index)
            return result
        raise self._all_failed(failures)

    def failed_at(self, index: int, error: grpc.RpcError) -> None:
        """A call that reached the coordinator at ``index`` broke later: move on if it says so."""
        if fails_over(_code(error)):
            self._failed(index)

    # ---- grpc.Channel ----
    def unary_unary(
        self, method: str, request_serializer: Any = None, response_deserializer: Any = None, **kwargs: Any
    ) -> grpc.UnaryUnaryMultiCallable[Any, Any]:
        """A unary method at every address."""
        return _UnaryUnary(
            self,
            [
                c.unary_unary(method, request_serializer, response_deserializer, **kwargs)
                for c in self._channels
            ],
        )

    def unary_stream(
        self, method: str, request_serializer: Any = None, response_deserializer: Any = None, **kwargs: Any
    ) -> grpc.UnaryStreamMultiCallable[Any, Any]:
        """A server-streaming method at every address."""
        return _UnaryStream(
            self,
            [
                c.unary_stream(method, request_serializer, response_deserializer, **kwargs)
                for c in self._channels
            ],
        )

    def stream_unary(
        self, method: str, request_serializer: Any = None, response_deserializer: Any = None, **kwargs: Any
    ) -> grpc.StreamUnaryMultiCallable[Any, Any]:
        """A client-streaming method: at the current address (its request stream cannot be replayed)."""
        return _StreamUnary(
            self,
            [
                c.stream_unary(method, request_serializer, response_deserializer, **kwargs)
                for c in self._channels
            ],
        )

    def stream_stream(
        self, method: str, request_serializer: Any = None, response_deserializer: Any = None, **kwargs: Any
    ) -> grpc.StreamStreamMultiCallable[Any, Any]:
        """A bidirectional method: at the current address (ControlService has none)."""
        return self._channels[self._current].stream_stream(
            method, request_serializer, response_deserializer, **kwargs
        )

    def subscribe(
        self, callback: Callable[[grpc.ChannelConnectivity], None], try_to_connect: bool = False
    ) -> None:
        """Follows the current address's channel."""
        self._channels[self._current].subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        """Stops following the current address's channel."""
        self._channels[self._current].unsubscribe(callback)

    def close(self) -> None:
        """Closes every address's channel."""
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> FailoverChannel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _UnaryUnary(_UnaryUnaryBase):
    def __init__(self, owner: FailoverChannel, methods: list[grpc.UnaryUnaryMultiCallable[Any, Any]]) -> None:
        self._owner = owner
        self._methods = methods

    def __call__(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return self._owner.call(lambda index: self._methods[index](request, *args, **kwargs))

    def with_call(self, request: Any, *args: Any, **kwargs: Any) -> tuple[Any, grpc.Call]:
        return self._owner.call(lambda index: self._methods[index].with_call(request, *args, **kwargs))

    def future(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return self._methods[self._owner._current].future(request, *args, **kwargs)


class _StreamUnary(_StreamUnaryBase):
    def __init__(
        self, owner: FailoverChannel, methods: list[grpc.StreamUnaryMultiCallable[Any, Any]]
    ) -> None:
        self._owner = owner
        self._methods = methods

    def __call__(self, request_iterator: Iterator[Any], *args: Any, **kwargs: Any) -> Any:
        index = self._owner._current
        try:
            return self._methods[index](request_iterator, *args, **kwargs)
        except grpc.RpcError as exc:
            self._owner.failed_at(index, exc)
            raise

    def with_call(self, request_iterator: Iterator[Any], *args: Any, **kwargs: Any) -> tuple[Any, grpc.Call]:
        index = self._owner._current
        try:
            return self._methods[index].with_call(request_iterator, *args, **kwargs)
        except grpc.RpcError as exc:
            self._owner.failed_at(index, exc)
            raise

    def future(self, request_iterator: Iterator[Any], *args: Any, **kwargs: Any) -> Any:
        return self._methods[self._owner._current].future(request_iterator, *args, **kwargs)


class _UnaryStream(_UnaryStreamBase):
    def __init__(
        self, owner: FailoverChannel, methods: list[grpc.UnaryStreamMultiCallable[Any, Any]]
    ) -> None:
        self._owner = owner
        self._methods = methods

    def __call__(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        return _FailoverStream(self._owner, lambda index: self._methods[index](request, *args, **kwargs))


class _FailoverStream:
    """A streamed response that moves to the next address until its first message (see FailoverChannel)."""

    def __init__(self, owner: FailoverChannel, start: Callable[[int], Iterator[Any]]) -> None:
        self._owner = owner
        self._start = start
        self._stream: Iterator[Any] | None = None
        self._index = -1

    def __iter__(self) -> _FailoverStream:
        return self

    def _first(self) -> Any:
        def attempt(index: int) -> tuple[Iterator[Any], Any]:
            stream = self._start(index)
            try:
                return stream, next(stream)
            except StopIteration:
                return stream, None

        stream, first = self._owner.call(attempt)
        self._stream, self._index = stream, self._owner._current
        if first is None:
            raise StopIteration
        return first

    def __next__(self) -> Any:
        if self._stream is None:
            return self._first()
        try:
            return next(self._stream)
        except grpc.RpcError as exc:
            self._owner.failed_at(self._index, exc)
            raise

    def cancel(self) -> bool:
        """Cancels the stream, if it started."""
        return bool(cast(grpc.Call, self._stream).cancel()) if self._stream is not None else False


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
    metavar="HOST:PORT[,HOST:PORT...]",
    help="The coordinator's address; several replicas comma-separated, each tried in turn when one is "
    "unreachable [env: FEDLINK_SERVER].",
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
    "FailoverChannel",
    "NoCoordinatorAnswered",
    "RpcFailed",
    "connection_options",
    "control_client",
    "echo_json",
    "echo_table",
    "fail",
    "format_option",
    "output_file",
    "rpc_failed",
]
