"""``fedlink health``: ask a coordinator's gRPC health service whether it serves (for probes and people).

Prints the status and exits 0 when it is SERVING, 1 otherwise (NOT_SERVING, an unknown service, an
unreachable or refusing coordinator: with a line saying which). It works in a runner-only install:
the health protocol's two messages are small enough to encode here (``grpc.health.v1``: a request
with ``string service = 1``, a response with the enum ``status = 1``), so neither the server extra's
``grpcio-health-checking`` nor generated stubs are needed. The TLS options are the operator commands'
(``fedlink job``): the data directory's CA by default, ``--ca-cert``, or ``--insecure``.

With several addresses (``--server a:8443,b:8443``) the check goes to each in turn until one answers,
as every operator command does (:class:`~fedlink.server.cli.client.FailoverChannel`): the line names the
address that answered, and its answer decides the exit code (NOT_SERVING is an answer, not a reason to
ask the next one). When none answers, the line names every address and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import click
import grpc

from fedlink.server.cli.client import (
    CA_CERT_OPTION,
    INSECURE_OPTION,
    SERVER_OPTION,
    ConnectionOptions,
    NoCoordinatorAnswered,
)
from fedlink.server.settings import default_data_dir

__all__ = ["EXIT_NOT_SERVING", "EXIT_SERVING", "check_health", "health_command"]

#: The health service's Check method.
CHECK_METHOD: Final = "/grpc.health.v1.Health/Check"
#: ``HealthCheckResponse.ServingStatus`` by number.
STATUS_NAMES: Final = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
EXIT_SERVING: Final = 0
EXIT_NOT_SERVING: Final = 1


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def encode_request(service: str) -> bytes:
    """A ``HealthCheckRequest`` on the wire: field 1 (``service``), length-delimited."""
    name = service.encode()
    return b"\x0a" + _varint(len(name)) + name if name else b""


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data):
            raise ValueError("truncated varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def decode_status(data: bytes) -> int:
    """The ``status`` of a ``HealthCheckResponse`` on the wire (0, UNKNOWN, when absent).

    Raises:
        ValueError: the bytes are not a protobuf message.
    """
    status, at = 0, 0
    while at < len(data):
        key, at = _read_varint(data, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _read_varint(data, at)
            if field == 1:
                status = value
        elif wire == 2:
            size, at = _read_varint(data, at)
            at += size
        elif wire == 1:
            at += 8
        elif wire == 5:
            at += 4
        else:
            raise ValueError(f"unexpected wire type {wire}")
        if at > len(data):
            raise ValueError("truncated field")
    return status


def check_health(channel: grpc.Channel, service: str = "", *, timeout: float = 5.0) -> str:
    """Calls ``grpc.health.v1.Health/Check``; returns the status name (``SERVING``, ...).

    Raises:
        grpc.RpcError: the call failed (unreachable, TLS refused, deadline, unknown service: NOT_FOUND).
        ValueError: the reply is not a health response.
    """
    call: grpc.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
        CHECK_METHOD, request_serializer=None, response_deserializer=None
    )
    reply = call(encode_request(service), timeout=timeout)
    status = decode_status(reply)
    return STATUS_NAMES.get(status, f"UNKNOWN({status})")


@click.command("health")
@SERVER_OPTION
@CA_CERT_OPTION
@INSECURE_OPTION
@click.option(
    "--data-dir",
    envvar="FEDLINK_DATA_DIR",
    type=click.Path(file_okay=False, path_type=Path),
    help="The coordinator's data directory, for its CA [env: FEDLINK_DATA_DIR].",
)
@click.option(
    "--service",
    default="",
    help="A service to ask about (fedlink.v1.RunnerService, fedlink.v1.ControlService); default: the "
    "whole coordinator.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=5.0,
    show_default=True,
    help="Seconds to wait for the answer (of each address, with several).",
)
def health_command(
    server: str, ca_cert: Path | None, insecure: bool, data_dir: Path | None, service: str, timeout: float
) -> None:
    """Check a coordinator's gRPC health: prints its status; exit 0 if SERVING, 1 otherwise.

    Needs no admin token (the health service answers anyone), so a container's HEALTHCHECK or a
    Kubernetes exec probe can run it.
    """
    options = ConnectionOptions(
        server=server,
        data_dir=(data_dir or default_data_dir()).expanduser(),
        ca_cert=ca_cert,
        insecure=insecure,
        admin_token=None,
    )
    with options.channel() as channel:
        try:
            status = check_health(channel, service, timeout=timeout)
        except NoCoordinatorAnswered as exc:
            click.echo(f"{server}: UNREACHABLE: {exc.details()}", err=True)
            raise click.exceptions.Exit(EXIT_NOT_SERVING) from None
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
            details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
            where = channel.address  # the one that answered, or the only one
            if code is grpc.StatusCode.NOT_FOUND:
                click.echo(f"{where}: SERVICE_UNKNOWN: no health status for service {service!r}")
            elif code is grpc.StatusCode.UNAVAILABLE:
                click.echo(f"{where}: UNREACHABLE: {details}", err=True)
            elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
                click.echo(f"{where}: NO ANSWER within {timeout:g}s", err=True)
            else:
                click.echo(f"{where}: health check failed: {code.name}: {details}", err=True)
            raise click.exceptions.Exit(EXIT_NOT_SERVING) from None
        except ValueError as exc:
            click.echo(
                f"{channel.address}: the health reply is not a grpc.health.v1 response: {exc}", err=True
            )
            raise click.exceptions.Exit(EXIT_NOT_SERVING) from None
        where = channel.address
    click.echo(f"{where}: {status}" + (f" ({service})" if service else ""))
    if status != "SERVING":
        raise click.exceptions.Exit(EXIT_NOT_SERVING)
