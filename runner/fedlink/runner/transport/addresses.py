"""Coordinator addresses: one or several, and when a failed call should go to the next one.

``--server`` (and ``FEDLINK_SERVER``) of ``fedlink runner`` and of the operator commands take one
address or several, comma-separated: ``coord-a.example:8443,coord-b.example:8443``. Each entry is
``host:port``, ``[v6]:port``, or ``dns:///host:port``; the same text means the same thing to every
command because :func:`parse_addresses` is the one parser.

**Which address serves, and why that way.** Each entry gets its own gRPC channel, and the callers fail
over between them in order (the first entry first; after a failover they stay on the address that
answered). Within one entry, gRPC's default ``dns`` resolver returns every A/AAAA record of the name
and its ``pick_first`` policy connects to the first record that accepts, moving on to the next one
when a connection fails: so one DNS name with a record per replica also works, with no list at all.
``pick_first`` rather than ``round_robin`` because a device's calls are a conversation (a long poll,
then its report, then the next poll) best kept on one replica and one TLS connection; spreading
devices over replicas is the DNS server's or the list order's business. Channels per entry, rather
than one channel over all entries, keep which address failed and why (refused, TLS...) for the
message, and work for host names, which gRPC's own multi-address targets (``ipv4:a,b``) do not take.

**What moves to the next address** (:func:`fails_over`): UNAVAILABLE (nothing listens, the connection
broke, TLS failed, or the replica says it cannot serve now) and DEADLINE_EXCEEDED (no answer in
time). A coordinator that answers with an error of its own (INVALID_ARGUMENT, PERMISSION_DENIED,
NOT_FOUND...) answered: every replica shares one store, so another would say the same.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import grpc

from fedlink.common.errors import InvalidArgument

__all__ = ["FAILOVER_CODES", "CoordinatorAddress", "fails_over", "parse_addresses"]

#: Status codes after which a call is tried at the next address.
FAILOVER_CODES: Final = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
#: ``dns:///host:port`` or ``dns://authority/host:port`` (gRPC's target syntax for its DNS resolver).
_DNS_TARGET: Final = re.compile(r"^dns:(?://[^/]*/)?(?P<rest>.+)$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class CoordinatorAddress:
    """One coordinator address as configured."""

    text: str
    """As given (``host:port`` or ``dns:///host:port``): the gRPC target, and the name in messages."""
    host: str
    """The host name or IP address (without the brackets of an IPv6 address)."""
    port: int

    def __str__(self) -> str:
        return self.text


def _parse_one(entry: str, what: str) -> CoordinatorAddress:
    dns = _DNS_TARGET.match(entry)
    host_port = dns.group("rest") if dns else entry
    host, sep, port = host_port.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise InvalidArgument(
            f"{what}: {entry!r} is not host:port (e.g. 127.0.0.1:8443, [::1]:8443 or dns:///coord:8443)"
        )
    if any(c.isspace() for c in host) or "/" in host or (not bracketed and ("[" in host or "]" in host)):
        raise InvalidArgument(f"{what}: {entry!r} is not host:port (a URL's scheme and path do not belong)")
    if ":" in host and not bracketed:
        raise InvalidArgument(f"{what}: {entry!r}: put an IPv6 address in brackets, e.g. [{host}]:{port}")
    return CoordinatorAddress(entry, host, int(port))


def parse_addresses(value: str | Sequence[str], *, what: str = "--server") -> tuple[CoordinatorAddress, ...]:
    """The coordinator addresses in ``value``: one ``host:port``, or several separated by commas (or
    given as a sequence, each item possibly comma-separated itself), in the order given.

    Blanks around entries and empty entries (a trailing comma) are ignored.

    Raises:
        InvalidArgument: no address, an entry that is not ``host:port`` with a port in 1..65535, an
            IPv6 address without brackets, or an address listed twice; the message names ``what``.
    """
    items = [value] if isinstance(value, str) else list(value)
    entries = [entry.strip() for item in items for entry in item.split(",")]
    addresses = tuple(_parse_one(entry, what) for entry in entries if entry)
    if not addresses:
        raise InvalidArgument(f"{what}: no coordinator address given (host:port, or several comma-separated)")
    seen: set[str] = set()
    for address in addresses:
        if address.text in seen:
            raise InvalidArgument(f"{what}: {address.text} is listed twice")
        seen.add(address.text)
    return addresses


def fails_over(code: grpc.StatusCode) -> bool:
    """Whether a call that failed with ``code`` should be tried at the next coordinator address.

    True for UNAVAILABLE and DEADLINE_EXCEEDED: this address cannot serve the call now. False for the
    rest: a coordinator that answered with an error of its own answered, and its replicas, sharing its
    store, would answer the same.
    """
    return code in FAILOVER_CODES
