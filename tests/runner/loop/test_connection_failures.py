"""A runner that cannot reach its coordinator says where and why, once at WARNING, then quietly at DEBUG;
it gives up after ``connect_timeout`` (or the job timeout) with the last cause, and a CA file that is
not PEM is refused before any connection is tried. Real coordinators on 127.0.0.1:0, TLS and plaintext.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from fedlink.common.errors import InvalidArgument, Unavailable
from fedlink.runner.loop import Runner
from fedlink.runner.transport.backoff import Backoff
from fedlink.runner.transport.connection import Cause
from fedlink.runner.transport.grpc_transport import GrpcTransport, GrpcTransportConfig
from fedlink.server.app import Coordinator
from fedlink.server.settings import CoordinatorSettings
from fedlink.server.tls import ensure_self_signed

TRANSPORT_LOGGER = "fedlink.runner.transport.grpc_transport"
CONNECT_TIMEOUT = timedelta(seconds=1.5)


def make_transport(server: str, state_dir: Path, **overrides: Any) -> GrpcTransport:
    settings: dict[str, Any] = {
        "connect_timeout": CONNECT_TIMEOUT,
        "per_request": timedelta(seconds=2),
        "backoff": Backoff(base=timedelta(milliseconds=50), cap=timedelta(milliseconds=200)),
    }
    settings.update(overrides)
    return GrpcTransport(GrpcTransportConfig(server=server, state_dir=state_dir, **settings))


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A port on 127.0.0.1 that refuses connections (bound, never listening) for as long as it is held."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@contextlib.contextmanager
def mute_port() -> Iterator[int]:
    """A port that takes connections (the kernel's backlog) but never says a word."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


@contextlib.asynccontextmanager
async def coordinator(data_dir: Path, **overrides: Any) -> AsyncIterator[Coordinator]:
    overrides.setdefault("listen_address", "127.0.0.1:0")
    settings = CoordinatorSettings(data_dir=data_dir, open_enrolment=True, **overrides)
    async with Coordinator(settings) as running:
        assert running.endpoint is not None
        yield running


@contextlib.asynccontextmanager
async def target(case: str, tmp: Path) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """The address to connect to and the transport's TLS settings for one way of getting it wrong."""
    if case == "refused":
        with closed_port() as port:
            yield f"127.0.0.1:{port}", {"insecure": True}
    elif case == "no_answer":
        with mute_port() as port:
            yield f"127.0.0.1:{port}", {"insecure": True, "per_request": timedelta(seconds=0.5)}
    elif case == "plaintext_to_tls":
        async with coordinator(tmp / "tls") as tls:
            yield tls.endpoint.address, {"insecure": True}  # type: ignore[union-attr]
    elif case == "tls_to_plaintext":
        ca = ensure_self_signed(tmp / "ca").ca_cert_path
        async with coordinator(tmp / "plain", insecure=True) as plain:
            yield plain.endpoint.address, {"ca_cert": ca}  # type: ignore[union-attr]
    elif case == "unknown_ca":
        other = ensure_self_signed(tmp / "other-ca").ca_cert_path
        async with coordinator(tmp / "tls") as tls:
            yield tls.endpoint.address, {"ca_cert": other}  # type: ignore[union-attr]
    elif case == "hostname_mismatch":
        async with coordinator(tmp / "tls", tls_hostnames=("coordinator.invalid",)) as tls:
            assert tls.endpoint is not None
            yield tls.endpoint.address, {"ca_cert": tls.endpoint.ca_cert}
    else:
        raise AssertionError(case)


#: case -> (cause, words the message must hold besides the address).
CASES: dict[str, tuple[Cause, str]] = {
    "refused": (Cause.REFUSED, "connection refused"),
    "no_answer": (Cause.TIMED_OUT, "no answer"),
    "plaintext_to_tls": (
        Cause.PLAINTEXT_TO_TLS,
        "the coordinator serves TLS and this runner speaks plaintext",
    ),
    "tls_to_plaintext": (Cause.TLS_TO_PLAINTEXT, "the coordinator answered in plaintext"),
    "unknown_ca": (Cause.UNKNOWN_CA, "not signed by a CA this runner trusts (the CA file "),
    "hostname_mismatch": (Cause.HOSTNAME_MISMATCH, "does not cover the host name '127.0.0.1'"),
}


def enroll_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == TRANSPORT_LOGGER and getattr(r, "rpc", "") == "Enroll"]


@pytest.mark.parametrize("case", list(CASES))
async def test_a_connection_failure_names_the_address_and_the_cause_once_then_gives_up(
    case: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cause, words = CASES[case]
    caplog.set_level(logging.DEBUG, logger=TRANSPORT_LOGGER)
    async with target(case, tmp_path) as (address, tls):
        transport = make_transport(address, tmp_path / "state", **tls)
        started = time.monotonic()
        with pytest.raises(Unavailable) as raised:
            await asyncio.wait_for(transport.open(), timeout=60)
        took = time.monotonic() - started
        await transport.close()

    message = raised.value.message
    assert f"cannot connect to the coordinator at {address}: " in message, message
    assert words in message, message
    assert "gave up after 1.5s" in message, message
    assert took >= CONNECT_TIMEOUT.total_seconds() - 0.05, f"gave up after {took:.2f}s"
    records = enroll_records(caplog)
    warnings = [r for r in records if r.levelno == logging.WARNING]
    retries = [r for r in records if r.levelno == logging.DEBUG]
    assert [r.cause for r in warnings] == [str(cause)], [r.getMessage() for r in records]  # type: ignore[attr-defined]
    assert address in warnings[0].getMessage() and words in warnings[0].getMessage()
    assert retries, "the retries after the first failure are logged at DEBUG"
    assert {r.cause for r in retries} == {str(cause)}  # type: ignore[attr-defined]
    assert not [r for r in records if r.levelno == logging.INFO], "no INFO line per retry"
    # Every failed attempt but the last (which raised) was logged once.
    assert len(transport.failed_attempts) == len(records) + 1


async def test_the_warning_comes_once_per_outage_and_the_recovery_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=TRANSPORT_LOGGER)
    with closed_port() as port:
        address = f"127.0.0.1:{port}"
        transport = make_transport(address, tmp_path / "state", insecure=True, connect_timeout=timedelta(0))
        opening = asyncio.create_task(transport.open())
        deadline = time.monotonic() + 60
        while len(enroll_records(caplog)) < 4:  # the warning and a few quiet retries
            assert time.monotonic() < deadline and not opening.done(), "no retries seen"
            await asyncio.sleep(0.02)
    # The port is free again: a coordinator comes up on it, and the runner gets through.
    async with coordinator(tmp_path / "coordinator", insecure=True, listen_address=address):
        await asyncio.wait_for(opening, timeout=60)
        await transport.close()
    records = enroll_records(caplog)
    assert [r.levelno for r in records].count(logging.WARNING) == 1
    assert {r.cause for r in records} == {"refused"}  # type: ignore[attr-defined]
    connected = [r.getMessage() for r in caplog.records if r.getMessage().startswith("connected to")]
    assert len(connected) == 1 and connected[0].startswith(f"connected to the coordinator at {address} after")
    assert transport.connection_problem == ""


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"not a certificate\n", "no start line"),
        (b"\x30\x82\x01\x0a\x02\x82\x01\x01\x00\xc3", "binary, not PEM text"),
        (b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n", "holds no PEM certificate"),
    ],
    ids=["text", "der", "damaged"],
)
def test_a_ca_file_that_is_not_pem_is_refused_before_connecting(
    tmp_path: Path, content: bytes, why: str
) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(content)
    with pytest.raises(InvalidArgument) as refused:
        make_transport("127.0.0.1:1", tmp_path / "state", ca_cert=ca)
    assert refused.value.message.startswith(f"the CA file {ca} holds no PEM certificate ("), refused.value
    assert why in refused.value.message
    with pytest.raises(InvalidArgument, match=f"cannot read the CA file {tmp_path / 'missing.pem'}"):
        make_transport("127.0.0.1:1", tmp_path / "state", ca_cert=tmp_path / "missing.pem")


async def test_the_job_timeout_ends_a_runner_stuck_enrolling(tmp_path: Path) -> None:
    with closed_port() as port:
        # No connect timeout: only the job timeout can end it.
        transport = make_transport(
            f"127.0.0.1:{port}", tmp_path / "state", insecure=True, connect_timeout=timedelta(0)
        )
        runner = Runner("", None, {}, {}, 1.0, transport=transport)
        started = time.monotonic()
        with pytest.raises(Unavailable) as raised:
            await asyncio.wait_for(runner.run_async(), timeout=60)
        took = time.monotonic() - started
    assert raised.value.message.startswith(
        f"could not connect and enrol within the job timeout (1s): cannot connect to the coordinator at "
        f"127.0.0.1:{port}: connection refused"
    ), raised.value.message
    assert 1.0 <= took < 30, f"ended after {took:.2f}s"
