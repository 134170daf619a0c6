"""Why the coordinator cannot be reached, said once, and how long the runner keeps trying.

gRPC reports every failure to connect as ``UNAVAILABLE`` (or, for a peer that never answers,
``DEADLINE_EXCEEDED``); the cause is only in the text of its details. :func:`classify` is the one place
that reads that text: it turns it into a :class:`ConnectionFailure` naming the address, the
:class:`Cause` and what to do about it, or ``None`` when the coordinator did answer (a fault it raised
itself is not a connection problem).

:class:`ConnectionWatch` follows one transport's outages: the first failure of a cause is logged at
WARNING, its retries at DEBUG, a change of cause at WARNING again, the recovery at INFO; and it says
when ``connect_timeout`` has been spent without a single answer (0: never). With several coordinator
addresses, causes are kept per address and the timeout runs until any of them answers.

:func:`read_ca_file` reads a CA bundle at start, so that a file that is not PEM is an error to fix,
not a handshake failure retried for ever.
"""

from __future__ import annotations

import enum
import logging
import math
import re
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Final

import grpc

from fedlink.common.errors import InvalidArgument, Unavailable

__all__ = ["Cause", "ConnectionFailure", "ConnectionWatch", "classify", "read_ca_file"]


class Cause(enum.StrEnum):
    """Why a connection to the coordinator failed (the ``cause`` field of the log records)."""

    REFUSED = "refused"
    """Nothing listens at the address (wrong port, or the coordinator is down)."""
    UNRESOLVED = "unresolved"
    """The host name does not resolve."""
    UNREACHABLE = "unreachable"
    """No route to the host."""
    TIMED_OUT = "timed_out"
    """The peer took the connection but never answered (a firewall, or not a gRPC server)."""
    PLAINTEXT_TO_TLS = "plaintext_to_tls"
    """The runner speaks plaintext (``insecure``) and the coordinator closed the connection: it serves TLS."""
    TLS_TO_PLAINTEXT = "tls_to_plaintext"
    """This runner speaks TLS and the peer answered in plaintext."""
    UNKNOWN_CA = "unknown_ca"
    """The coordinator's certificate is not signed by a CA this runner trusts."""
    HOSTNAME_MISMATCH = "hostname_mismatch"
    """The coordinator's certificate does not cover the host name the runner connects to."""
    CERTIFICATE_EXPIRED = "certificate_expired"
    """The coordinator's certificate has expired (or is not valid yet: a clock off by a lot)."""
    TLS_HANDSHAKE = "tls_handshake"
    """Another TLS handshake failure."""
    BAD_CA = "bad_ca"
    """gRPC could not load the CA certificates."""
    CLOSED = "closed"
    """The connection was closed before the coordinator answered."""
    OTHER = "other"
    """A failure to connect that none of the above describes (the detail says what gRPC said)."""


@dataclass(frozen=True, slots=True)
class ConnectionFailure:
    """One failure to reach the coordinator: where, why, and what to do."""

    address: str
    """The coordinator's address as configured (``host:port``)."""
    cause: Cause
    reason: str
    """The cause in words, with the hint that helps."""
    detail: str
    """What gRPC said, for DEBUG."""

    def __str__(self) -> str:
        return f"cannot connect to the coordinator at {self.address}: {self.reason}"


#: (cause, pattern in gRPC's details), the first match wins; the order matters (a handshake failure
#: mentions "Tls handshake failed" and then the reason).
_PATTERNS: Final[tuple[tuple[Cause, re.Pattern[str]], ...]] = tuple(
    (cause, re.compile(pattern, re.IGNORECASE))
    for cause, pattern in (
        (Cause.REFUSED, r"connection refused"),
        (Cause.UNRESOLVED, r"errors resolving|DNS resolution failed|hostname lookup error|name not found"),
        (Cause.UNREACHABLE, r"no route to host|network is unreachable|host is unreachable"),
        (Cause.TIMED_OUT, r"timed out|deadline exceeded"),
        (Cause.HOSTNAME_MISMATCH, r"hostname verification|no match found for server name|host name mismatch"),
        (Cause.CERTIFICATE_EXPIRED, r"certificate has expired|certificate is not yet valid"),
        (
            Cause.UNKNOWN_CA,
            r"unable to get local issuer|self[- ]signed certificate|unknown ca|CERTIFICATE_VERIFY",
        ),
        (Cause.TLS_TO_PLAINTEXT, r"WRONG_VERSION_NUMBER|packet length too long|http request|record layer"),
        (Cause.BAD_CA, r"security handshaker|root certificate"),
        (Cause.TLS_HANDSHAKE, r"handshake|SSL_ERROR|TSI_"),
        (Cause.CLOSED, r"socket closed|connection reset|broken pipe|end of tcp stream|connection closed"),
        (Cause.OTHER, r"failed to connect"),
    )
)
_SSL_REASON: Final = re.compile(r"OPENSSL_internal:([A-Z_]+)")
_DNS_PREFIX: Final = re.compile(r"^dns:(?://[^/]*/)?", re.IGNORECASE)


def classify(
    code: grpc.StatusCode,
    details: str,
    *,
    address: str,
    tls: bool,
    ca_file: Path | None = None,
    connected: bool = False,
    answered_before: bool = False,
) -> ConnectionFailure | None:
    """The connection failure a failed call's status describes, or ``None`` if the coordinator answered.

    Args:
        code: The call's status code.
        details: Its details (``AioRpcError.details()``), where gRPC puts the cause.
        address: The coordinator's address as configured, for the message.
        tls: Whether the runner connects with TLS.
        ca_file: The CA bundle it trusts (``None``: the system's roots), for the message.
        connected: Whether the channel is connected (then a deadline is the coordinator's slowness).
        answered_before: Whether this coordinator ever answered on this channel (then a closed connection
            is not a sign of plaintext against TLS).
    """
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        if connected:
            return None  # the coordinator is slow, not unreachable
        return ConnectionFailure(
            address, Cause.TIMED_OUT, _reason(Cause.TIMED_OUT, details, address, tls, ca_file), details
        )
    if code is not grpc.StatusCode.UNAVAILABLE:
        return None
    cause = next((cause for cause, pattern in _PATTERNS if pattern.search(details)), None)
    if cause is None:
        return None  # the coordinator itself said UNAVAILABLE (shutting down, its store away...)
    if cause is Cause.CLOSED and not tls and not answered_before:
        cause = Cause.PLAINTEXT_TO_TLS
    return ConnectionFailure(address, cause, _reason(cause, details, address, tls, ca_file), details)


def _reason(cause: Cause, details: str, address: str, tls: bool, ca_file: Path | None) -> str:
    host = _DNS_PREFIX.sub("", address).rsplit(":", 1)[0].strip("[]")
    trusted = f"the CA file {ca_file}" if ca_file is not None else "the system's root CAs"
    ssl_reason = _SSL_REASON.search(details)
    match cause:
        case Cause.REFUSED:
            return (
                "connection refused: nothing listens there (is the coordinator running, and the port right?)"
            )
        case Cause.UNRESOLVED:
            return f"the host name {host!r} does not resolve"
        case Cause.UNREACHABLE:
            return "no route to the host (network down, or a wrong address?)"
        case Cause.TIMED_OUT:
            return (
                "no answer: the connection was not set up in time (a firewall dropping packets, a wrong "
                "address, or not a gRPC server?)"
            )
        case Cause.PLAINTEXT_TO_TLS:
            return (
                "the connection was closed during setup: the coordinator serves TLS and this runner speaks "
                "plaintext (--insecure); drop --insecure and pass the coordinator's CA with --ca-cert"
            )
        case Cause.TLS_TO_PLAINTEXT:
            return (
                "TLS handshake failed: the coordinator answered in plaintext (it runs with --insecure); "
                "serve TLS, or connect with --insecure on a trusted network"
            )
        case Cause.UNKNOWN_CA:
            return (
                f"TLS handshake failed: the coordinator's certificate is not signed by a CA this runner "
                f"trusts ({trusted}); pass the coordinator's CA with --ca-cert (fedlink serve prints where "
                f"it is)"
            )
        case Cause.HOSTNAME_MISMATCH:
            return (
                f"TLS handshake failed: the coordinator's certificate does not cover the host name {host!r}; "
                f"connect with a name it covers, or add {host!r} to it (fedlink serve --tls-hostnames)"
            )
        case Cause.CERTIFICATE_EXPIRED:
            return "TLS handshake failed: the coordinator's certificate has expired (or a clock is wrong)"
        case Cause.BAD_CA:
            return f"TLS setup failed: gRPC could not load {trusted}"
        case Cause.TLS_HANDSHAKE:
            return "TLS handshake failed" + (f": {ssl_reason.group(1)}" if ssl_reason else f" ({details})")
        case Cause.CLOSED:
            return "the connection was closed before the coordinator answered"
        case _:
            return details


def read_ca_file(path: Path) -> bytes:
    """The PEM CA bundle at ``path``, checked to hold at least one certificate.

    Raises:
        InvalidArgument: the file cannot be read, or is not PEM certificates; the message names it.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read the CA file {path}: {exc.strerror}") from None
    try:
        # The standard library parses it as gRPC will; no certificate, or a damaged one, is refused.
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=data.decode("ascii"))
    except (UnicodeDecodeError, ssl.SSLError, ValueError) as exc:
        why = "binary, not PEM text" if isinstance(exc, UnicodeDecodeError) else str(exc).split(" (_ssl")[0]
        raise InvalidArgument(
            f"the CA file {path} holds no PEM certificate ({why}); --ca-cert takes the coordinator's CA "
            f"certificate, '-----BEGIN CERTIFICATE-----' ..., as fedlink serve writes it (tls/ca.pem)"
        ) from None
    return data


class ConnectionWatch:
    """Follows one transport's outages: logs each cause once, and tells when to give up.

    A transport with several coordinator addresses has one watch for all of them: each address keeps
    its own last failure and the cause it was warned about, while the outage (and ``connect_timeout``)
    runs from the first failure until *any* address answers.

    Not thread-safe: one transport, one event loop.
    """

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        tls: bool,
        ca_file: Path | None,
        connect_timeout: timedelta,
        logger: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Creates a watch.

        Args:
            address: The coordinator's address, or its addresses, for the messages.
            tls: Whether the transport connects with TLS.
            ca_file: The CA bundle it trusts, for the messages.
            connect_timeout: How long an outage may last before :meth:`failed` raises; 0: for ever.
            logger: Where to log.
            clock: Monotonic seconds (tests move it).
        """
        self.addresses: tuple[str, ...] = (address,) if isinstance(address, str) else tuple(address)
        #: The first address (the one a single-address transport has).
        self.address = self.addresses[0]
        self._tls = tls
        self._ca_file = ca_file
        self._timeout = connect_timeout.total_seconds()
        self._log = logger
        self._clock = clock
        #: Start of the outage in progress: no address has answered since.
        self._since: float | None = None
        #: Per address: the cause last warned about, and when its failures began (for the recovery line).
        self._warned: dict[str, Cause] = {}
        self._down_since: dict[str, float] = {}
        self._answered: set[str] = set()
        #: The last failure of each address during the outage in progress (for the give-up message).
        self._failures: dict[str, ConnectionFailure] = {}
        #: The latest failure of the outage in progress (None when the coordinator answers).
        self.last: ConnectionFailure | None = None

    def answered(self, address: str | None = None) -> None:
        """The coordinator at ``address`` (default: the first) answered, with a reply or a fault of its
        own: the outage is over."""
        where = self.address if address is None else address
        since = self._down_since.pop(where, None)
        if self._warned.pop(where, None) is not None and since is not None:
            self._log.info(
                f"connected to the coordinator at {where} after {self._clock() - since:.1f}s",
                extra={"server": where},
            )
        self._answered.add(where)
        self._since = self.last = None
        self._failures.clear()

    def remaining(self) -> float:
        """Seconds left before the outage in progress outlasts ``connect_timeout`` (inf: no limit)."""
        if self._timeout <= 0 or self._since is None:
            return math.inf
        return self._since + self._timeout - self._clock()

    def describe(self) -> str:
        """The outage in progress in words: each address that failed and why ("" if none)."""
        if len(self._failures) <= 1 or len(self.addresses) == 1:
            return "" if self.last is None else str(self.last)
        causes = "; ".join(f"{address}: {failure.reason}" for address, failure in self._failures.items())
        return f"cannot connect to any of the coordinators at {', '.join(self._failures)}: {causes}"

    def failed(
        self,
        rpc: str,
        code: grpc.StatusCode,
        details: str,
        *,
        connected: bool,
        retry: int,
        delay: float,
        address: str | None = None,
        next_address: str | None = None,
    ) -> ConnectionFailure | None:
        """Records a failed attempt of ``rpc``; returns its connection failure (None: not one).

        Logs the failure at WARNING the first time its cause is seen at that address in an outage, else
        at DEBUG. The caller waits ``min(delay, remaining())`` before its next attempt, so the last one
        lands at the timeout itself.

        Args:
            rpc: The call's name, for the messages.
            code: Its status code.
            details: Its details.
            connected: Whether the channel was connected.
            retry: The number of the retry that comes next (from 1).
            delay: The wait before it, in seconds.
            address: The address the call went to (default: the first).
            next_address: The address the retry goes to, when it is another one.

        Raises:
            Unavailable: the outage has lasted ``connect_timeout``; the message names the last cause at
                every address that failed.
        """
        where = self.address if address is None else address
        failure = classify(
            code,
            details,
            address=where,
            tls=self._tls,
            ca_file=self._ca_file,
            connected=connected,
            answered_before=where in self._answered,
        )
        if failure is None:
            self.answered(where)
            return None
        now = self._clock()
        if self._since is None:
            self._since = now
        self._down_since.setdefault(where, now)
        self.last = failure
        self._failures[where] = failure
        fields = {"rpc": rpc, "server": where, "cause": str(failure.cause), "attempt": retry}
        remaining = self.remaining()
        if remaining <= 0:
            raise Unavailable(
                f"{rpc}: gave up after {self._timeout:g}s without a connection (connect_timeout): "
                f"{self.describe()}"
            )
        delay = min(delay, remaining)
        moving = next_address is not None and next_address != where
        then = (
            f"trying {next_address} now"
            if moving and delay <= 0
            else f"retry {retry}{f' at {next_address}' if moving else ''} in {delay:.3f}s"
        )
        if failure.cause is not self._warned.get(where):
            self._warned[where] = failure.cause
            limit = (
                f"gives up after {self._timeout:g}s (--connect-timeout)" if self._timeout > 0 else "for ever"
            )
            self._log.warning(
                f"{rpc}: {failure}; {then}, then quietly while the cause stays the same; {limit}",
                extra=fields,
            )
        else:
            self._log.debug(f"{rpc}: {failure}; {then}", extra={**fields, "detail": details})
        return failure
