"""Self-signed TLS material: made once, reused, renewed when due, and accepted only by the right peers."""

from __future__ import annotations

import os
import stat
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedlink.common.errors import InvalidArgument
from fedlink.server.tls import (
    TlsMaterial,
    ensure_self_signed,
    issue_client_certificate,
    load_channel_credentials,
    load_server_credentials,
)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def material(tmp_path: Path) -> TlsMaterial:
    return ensure_self_signed(tmp_path / "tls")


async def _start(credentials: grpc.ServerCredentials) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return server, port


@pytest.fixture
async def tls_port(material: TlsMaterial) -> AsyncIterator[int]:
    server, port = await _start(load_server_credentials(material.cert_path, material.key_path))
    yield port
    await server.stop(None)


async def _check(channel: grpc.aio.Channel) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        return response.status


async def _code_of(channel: grpc.aio.Channel) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _check(channel)
    return caught.value.code()


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_files_and_modes(material: TlsMaterial) -> None:
    assert _mode(material.ca_key_path) == 0o600
    assert _mode(material.key_path) == 0o600
    assert _mode(material.ca_cert_path) == 0o644
    assert _mode(material.cert_path) == 0o644
    assert _mode(material.cert_path.parent) == 0o700
    assert sorted(p.name for p in material.cert_path.parent.iterdir()) == [
        "ca.key",
        "ca.pem",
        "server.key",
        "server.pem",
    ]


def test_server_certificate_is_signed_by_the_ca_and_names_the_hosts(tmp_path: Path) -> None:
    material = ensure_self_signed(tmp_path, ["coord.example", "localhost", "10.1.2.3", "::1"])
    ca, leaf = _cert(material.ca_cert_path), _cert(material.cert_path)
    leaf.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["coord.example", "localhost"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.1.2.3", "::1"]


def test_material_is_reused_on_later_starts(tmp_path: Path) -> None:
    first = ensure_self_signed(tmp_path)
    before = {p: p.read_bytes() for p in (first.ca_cert_path, first.ca_key_path, first.cert_path)}
    second = ensure_self_signed(tmp_path)
    assert second == first
    assert {p: p.read_bytes() for p in before} == before


def test_expired_material_is_replaced(tmp_path: Path) -> None:
    long_ago = datetime.now(UTC) - timedelta(days=4000)  # beyond the CA's ten years
    old = ensure_self_signed(tmp_path, now=long_ago)
    old_ca = old.ca_cert_path.read_bytes()
    new = ensure_self_signed(tmp_path)
    assert new.ca_cert_path.read_bytes() != old_ca
    assert _cert(new.cert_path).not_valid_after_utc > datetime.now(UTC)
    _cert(new.cert_path).verify_directly_issued_by(_cert(new.ca_cert_path))


def test_a_server_certificate_due_for_renewal_is_reissued_by_the_same_ca(tmp_path: Path) -> None:
    old = ensure_self_signed(tmp_path, now=datetime.now(UTC) - timedelta(days=390))  # 7 days left
    old_ca, old_leaf = old.ca_cert_path.read_bytes(), old.cert_path.read_bytes()
    new = ensure_self_signed(tmp_path)
    assert new.ca_cert_path.read_bytes() == old_ca  # runners keep trusting the same CA
    assert new.cert_path.read_bytes() != old_leaf


def test_new_hostnames_reissue_the_server_certificate(tmp_path: Path) -> None:
    ensure_self_signed(tmp_path, ["localhost"])
    material = ensure_self_signed(tmp_path, ["localhost", "coord.example"])
    sans = _cert(material.cert_path).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "coord.example" in sans.get_values_for_type(x509.DNSName)


def test_a_lost_server_key_is_regenerated(tmp_path: Path) -> None:
    material = ensure_self_signed(tmp_path)
    material.key_path.unlink()
    ensure_self_signed(tmp_path)
    load_server_credentials(material.cert_path, material.key_path)  # checks that key and cert match


@pytest.mark.parametrize("hostnames", [[], ["bad host"], ["a/b"]])
def test_bad_hostnames_are_refused(tmp_path: Path, hostnames: list[str]) -> None:
    with pytest.raises(InvalidArgument):
        ensure_self_signed(tmp_path, hostnames)


def test_mismatched_or_missing_files_are_clear_errors(tmp_path: Path) -> None:
    a = ensure_self_signed(tmp_path / "a")
    b = ensure_self_signed(tmp_path / "b")
    with pytest.raises(InvalidArgument, match="does not belong to the certificate"):
        load_server_credentials(a.cert_path, b.key_path)
    with pytest.raises(InvalidArgument, match="cannot read the TLS certificate"):
        load_server_credentials(tmp_path / "none.pem", a.key_path)
    (tmp_path / "junk.pem").write_text("hello")
    with pytest.raises(InvalidArgument, match="not a PEM file"):
        load_channel_credentials(tmp_path / "junk.pem")
    with pytest.raises(InvalidArgument, match="go together"):
        load_channel_credentials(a.ca_cert_path, client_cert=a.cert_path)


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
async def test_a_client_trusting_the_ca_is_served(material: TlsMaterial, tls_port: int, host: str) -> None:
    channel = grpc.aio.secure_channel(f"{host}:{tls_port}", load_channel_credentials(material.ca_cert_path))
    assert await _check(channel) == health_pb2.HealthCheckResponse.SERVING


async def test_a_plaintext_client_is_refused(tls_port: int) -> None:
    assert await _code_of(grpc.aio.insecure_channel(f"127.0.0.1:{tls_port}")) == grpc.StatusCode.UNAVAILABLE


async def test_a_client_trusting_another_ca_is_refused(tmp_path: Path, tls_port: int) -> None:
    other = ensure_self_signed(tmp_path / "other")
    channel = grpc.aio.secure_channel(f"localhost:{tls_port}", load_channel_credentials(other.ca_cert_path))
    assert await _code_of(channel) == grpc.StatusCode.UNAVAILABLE


async def test_a_hostname_outside_the_certificate_is_refused(material: TlsMaterial, tls_port: int) -> None:
    channel = grpc.aio.secure_channel(
        f"127.0.0.1:{tls_port}",
        load_channel_credentials(material.ca_cert_path),
        options=[("grpc.ssl_target_name_override", "elsewhere.example")],
    )
    assert await _code_of(channel) == grpc.StatusCode.UNAVAILABLE


async def test_mutual_tls_requires_a_client_certificate_from_the_client_ca(
    tmp_path: Path, material: TlsMaterial
) -> None:
    issue_client_certificate(material, "device-1", tmp_path / "client.pem", tmp_path / "client.key")
    assert _mode(tmp_path / "client.key") == 0o600
    rogue = ensure_self_signed(tmp_path / "rogue")
    issue_client_certificate(rogue, "intruder", tmp_path / "rogue.pem", tmp_path / "rogue.key")
    server, port = await _start(
        load_server_credentials(material.cert_path, material.key_path, client_ca=material.ca_cert_path)
    )
    target = f"localhost:{port}"
    try:
        with_cert = load_channel_credentials(
            material.ca_cert_path, tmp_path / "client.pem", tmp_path / "client.key"
        )
        assert (
            await _check(grpc.aio.secure_channel(target, with_cert)) == health_pb2.HealthCheckResponse.SERVING
        )
        without = load_channel_credentials(material.ca_cert_path)
        assert await _code_of(grpc.aio.secure_channel(target, without)) == grpc.StatusCode.UNAVAILABLE
        wrong = load_channel_credentials(
            material.ca_cert_path, tmp_path / "rogue.pem", tmp_path / "rogue.key"
        )
        assert await _code_of(grpc.aio.secure_channel(target, wrong)) == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(None)
