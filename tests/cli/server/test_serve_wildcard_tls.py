"""``serve`` on a wildcard address with its self-signed certificate: the certificate covers the host's
names and addresses (devices do not reach it as localhost), and the log says which, and which flag adds
others. Traffic stays on 127.0.0.1: the TLS handshake is made there with the host's name as target."""

from __future__ import annotations

import ipaddress
import logging
import socket
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedlink.server.app import Coordinator
from fedlink.server.settings import CoordinatorSettings
from fedlink.server.tls import host_names_and_addresses


def san(cert_path: Path) -> tuple[set[str], set[str]]:
    """The DNS names and IP addresses of a certificate's subject alternative names."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return set(names.get_values_for_type(x509.DNSName)), {
        str(ip) for ip in names.get_values_for_type(x509.IPAddress)
    }


def trusting(ca: Path) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(ca.read_bytes())


async def health_via(port: int, ca: Path, server_name: str) -> int:
    """A health check over 127.0.0.1 whose TLS handshake checks the certificate for ``server_name``."""
    credentials = trusting(ca)
    options = [("grpc.ssl_target_name_override", server_name)]
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials, options=options) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return int(reply.status)


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "[::]"])
async def test_a_wildcard_address_puts_the_hosts_names_in_the_certificate_and_says_so(
    wildcard: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    if wildcard == "[::]" and not socket.has_ipv6:
        pytest.fail("this machine has no IPv6 sockets")  # never skipped silently
    caplog.set_level(logging.INFO, logger="fedlink.server.app")
    host = host_names_and_addresses()
    assert socket.gethostname() in host or socket.gethostname() == "localhost", host
    settings = CoordinatorSettings(data_dir=tmp_path / "data", listen_address=f"{wildcard}:0")
    async with Coordinator(settings) as coordinator:
        endpoint = coordinator.endpoint
        assert endpoint is not None and endpoint.ca_cert is not None
        dns, ips = san(settings.tls_dir / "server.pem")
        # The configured names first, then every name and address of the host.
        assert endpoint.tls_names[:2] == ("localhost", "127.0.0.1")
        assert set(host) <= set(endpoint.tls_names)
        for name in host:
            try:
                assert str(ipaddress.ip_address(name)) in ips, (name, ips)
            except ValueError:
                assert name in dns, (name, dns)
        if host:  # a device that knows the coordinator by the host's first name gets through
            serving = health_pb2.HealthCheckResponse.SERVING
            assert await health_via(endpoint.port, endpoint.ca_cert, host[0]) == serving
        with pytest.raises(grpc.aio.AioRpcError) as mismatch:  # and the check is real
            await health_via(endpoint.port, endpoint.ca_cert, "not-covered.invalid")
        assert mismatch.value.code() is grpc.StatusCode.UNAVAILABLE
    said = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("self-signed TLS certificate")
    ]
    assert said == [
        f"self-signed TLS certificate for {', '.join(endpoint.tls_names)}; for other names: --tls-hostnames "
        "(or your own certificate: --tls-cert/--tls-key)"
    ]


async def test_a_loopback_address_keeps_the_configured_names_only(tmp_path: Path) -> None:
    settings = CoordinatorSettings(
        data_dir=tmp_path / "data", listen_address="127.0.0.1:0", tls_hostnames=("localhost", "127.0.0.1")
    )
    async with Coordinator(settings) as coordinator:
        assert coordinator.endpoint is not None
        assert coordinator.endpoint.tls_names == ("localhost", "127.0.0.1")
    assert san(settings.tls_dir / "server.pem") == ({"localhost"}, {"127.0.0.1"})
