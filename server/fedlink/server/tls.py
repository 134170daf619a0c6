"""TLS material for the coordinator: a self-signed CA and server certificate, and gRPC credentials.

``fedlink serve`` with no TLS flags creates, once, a private CA and a server certificate it signed, in
the TLS directory of the data dir; runners trust the CA file (its path is printed at start). Later starts
reuse them: the CA is replaced only when missing or expired (runners must then trust the new one), the
server certificate also when it is about to expire, when it no longer covers the requested hostnames, or
when the CA changed. Keys are ECDSA P-256 and written 0600. One coordinator per data dir is assumed.

On a wildcard listen address (``0.0.0.0``, ``::``), devices reach the coordinator by the host's names
and addresses, not by localhost: :func:`certificate_names` adds the host name, its fully qualified name
and the addresses of the host's interfaces (found with the standard library only) to the configured
``tls_hostnames``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import socket
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedlink.common.errors import InvalidArgument

#: How long a generated CA is valid. Long, because replacing it means every runner must trust a new one.
CA_VALIDITY: Final = timedelta(days=3650)
#: How long a generated server or client certificate is valid.
CERT_VALIDITY: Final = timedelta(days=397)
#: A server certificate expiring sooner than this is reissued at start.
RENEW_BEFORE: Final = timedelta(days=30)

_KEY_MODE: Final = 0o600
_CERT_MODE: Final = 0o644
_DIR_MODE: Final = 0o700
# Backdated so that a peer whose clock is slightly behind still accepts a fresh certificate.
_CLOCK_SKEW: Final = timedelta(minutes=5)


@dataclass(frozen=True, slots=True, kw_only=True)
class TlsMaterial:
    """Paths of the PEM files of a self-signed setup."""

    ca_cert_path: Path
    """The CA certificate that runners and operator tools trust."""

    ca_key_path: Path
    """The CA's private key (0600); it signs the server certificate and, if wanted, client ones."""

    cert_path: Path
    """The server certificate, signed by the CA."""

    key_path: Path
    """The server's private key (0600)."""


def ensure_self_signed(
    tls_dir: Path,
    hostnames: Sequence[str] = ("localhost", "127.0.0.1"),
    *,
    now: datetime | None = None,
) -> TlsMaterial:
    """Returns the self-signed CA and server certificate in ``tls_dir``, creating what is missing.

    Args:
        tls_dir: Where the files live (``CoordinatorSettings.tls_dir``); created 0700 if missing.
        hostnames: DNS names and IP addresses the server certificate must be valid for.
        now: The current time (tests move it); default: the system clock.

    Raises:
        InvalidArgument: no hostnames, or one that is neither a DNS name nor an IP address.
    """
    names = _subject_alt_names(hostnames)
    moment = now or datetime.now(UTC)
    material = TlsMaterial(
        ca_cert_path=tls_dir / "ca.pem",
        ca_key_path=tls_dir / "ca.key",
        cert_path=tls_dir / "server.pem",
        key_path=tls_dir / "server.key",
    )
    tls_dir.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    ca = _usable_pair(material.ca_cert_path, material.ca_key_path, moment, margin=timedelta(0))
    if ca is None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _build_ca(ca_key, moment)
        _write_key(material.ca_key_path, ca_key)
        _write_cert(material.ca_cert_path, ca_cert)
    else:
        ca_cert, ca_key = ca
    server = _usable_pair(material.cert_path, material.key_path, moment, margin=RENEW_BEFORE)
    if server is None or not _fits(server[0], ca_cert, names):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(ca_cert, ca_key, key, hostnames[0], names, server=True, now=moment)
        _write_key(material.key_path, key)
        _write_cert(material.cert_path, cert)
    return material


def issue_client_certificate(
    material: TlsMaterial, common_name: str, cert_path: Path, key_path: Path, *, now: datetime | None = None
) -> None:
    """Issues a client certificate signed by the self-signed CA (for mutual TLS in small setups).

    Raises:
        InvalidArgument: the CA files cannot be read.
    """
    ca_cert = _read_cert(material.ca_cert_path)
    ca_key = _read_key(material.ca_key_path)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _issue(ca_cert, ca_key, key, common_name, [], server=False, now=now or datetime.now(UTC))
    _write_key(key_path, key)
    _write_cert(cert_path, cert)


def load_server_credentials(cert: Path, key: Path, client_ca: Path | None = None) -> grpc.ServerCredentials:
    """Server credentials from PEM files; with ``client_ca``, every client must present a certificate.

    Raises:
        InvalidArgument: a file is missing or not PEM, or the key does not belong to the certificate.
    """
    chain = _read_pem(cert, "certificate")
    private = _read_pem(key, "private key")
    _check_pair(cert, chain, key, private)
    roots = None
    if client_ca is not None:
        roots = _read_pem(client_ca, "client CA")
        _parse_certs(client_ca, roots)
    return grpc.ssl_server_credentials(
        [(private, chain)], root_certificates=roots, require_client_auth=roots is not None
    )


def load_channel_credentials(
    ca_path: Path, client_cert: Path | None = None, client_key: Path | None = None
) -> grpc.ChannelCredentials:
    """Channel credentials trusting the CA in ``ca_path``, optionally presenting a client certificate.

    Raises:
        InvalidArgument: a file is missing or not PEM, or only one of client_cert/client_key is given.
    """
    if (client_cert is None) != (client_key is None):
        raise InvalidArgument("client_cert and client_key go together")
    roots = _read_pem(ca_path, "CA certificate")
    _parse_certs(ca_path, roots)
    chain = private = None
    if client_cert is not None and client_key is not None:
        chain = _read_pem(client_cert, "client certificate")
        private = _read_pem(client_key, "client private key")
        _check_pair(client_cert, chain, client_key, private)
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=private, certificate_chain=chain)


# ---- the names a certificate covers -------------------------------------------------------------------

#: Hosts of a listen address that accept connections on every interface.
_WILDCARD_HOSTS: Final = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
_SIOCGIFADDR: Final = 0x8915  # Linux: an interface's IPv4 address


def is_wildcard_address(listen_address: str) -> bool:
    """Whether ``host:port`` listens on every interface (``0.0.0.0:8443``, ``[::]:8443``, ``:8443``)."""
    return listen_address.rsplit(":", 1)[0] in _WILDCARD_HOSTS


def certificate_names(listen_address: str, configured: Sequence[str]) -> tuple[str, ...]:
    """The names a self-signed server certificate should cover: ``configured``, and on a wildcard listen
    address also this host's names and non-loopback addresses (see :func:`host_names_and_addresses`)."""
    names = list(dict.fromkeys(configured))
    if is_wildcard_address(listen_address):
        names += [name for name in host_names_and_addresses() if name not in names]
    return tuple(names)


def host_names_and_addresses() -> list[str]:
    """This host's name, its fully qualified name, and its interfaces' addresses (loopback, link-local
    and unusable ones left out): what devices on the network are likely to connect to.

    Only the standard library: the IPv4 addresses of the interfaces on Linux (an ioctl per interface),
    the IPv6 ones from ``/proc/net/if_inet6``, and what the host's names resolve to everywhere.
    """
    names: list[str] = []
    hostname = socket.gethostname()
    for name in (hostname, socket.getfqdn()):
        if name and name not in names and _is_dns_name(name) and name != "localhost":
            names.append(name)
    addresses = [*_interface_addresses(), *_resolved(names)]
    usable = [address for address in addresses if _usable(address)]
    return names + sorted(
        set(usable), key=lambda a: (ipaddress.ip_address(a).version, ipaddress.ip_address(a))
    )


def _is_dns_name(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return not any(c.isspace() or c in "/:@" for c in name)
    return False


def _usable(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return not (ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast)


def _interface_addresses() -> Iterator[str]:
    if sys.platform.startswith("linux") and hasattr(socket, "if_nameindex"):
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _, interface in socket.if_nameindex():
                request = struct.pack("256s", interface.encode()[:15])
                try:
                    reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
                except OSError:
                    continue  # no IPv4 address on this interface
                yield socket.inet_ntoa(reply[20:24])
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            yield str(ipaddress.IPv6Address(bytes.fromhex(line.split()[0])))


def _resolved(names: Sequence[str]) -> Iterator[str]:
    for name in names:
        try:
            infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
        except OSError:
            continue
        for info in infos:
            yield str(info[4][0]).split("%", 1)[0]


# ---- building certificates ----------------------------------------------------------------------------


def _subject_alt_names(hostnames: Sequence[str]) -> list[x509.GeneralName]:
    if isinstance(hostnames, str) or not hostnames:
        raise InvalidArgument("the certificate needs a sequence of at least one hostname")
    names: list[x509.GeneralName] = []
    for host in hostnames:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
            continue
        except ValueError:
            pass
        if not host or any(c.isspace() or c in "/:@" for c in host):
            raise InvalidArgument(f"{host!r} is neither a DNS name nor an IP address")
        names.append(x509.DNSName(host))
    return names


def _build_ca(key: ec.EllipticCurvePrivateKey, now: datetime) -> x509.Certificate:
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedlink"),
            # A random suffix: two coordinators' CAs never look like the same issuer.
            x509.NameAttribute(NameOID.COMMON_NAME, f"fedlink coordinator CA {secrets.token_hex(4)}"),
        ]
    )
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(now + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )


def _issue(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    key: ec.EllipticCurvePrivateKey,
    common_name: str,
    names: list[x509.GeneralName],
    *,
    server: bool,
    now: datetime,
) -> x509.Certificate:
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _CLOCK_SKEW)
        .not_valid_after(min(now + CERT_VALIDITY, ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def _usable_pair(
    cert_path: Path, key_path: Path, now: datetime, *, margin: timedelta
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    """The certificate and key at these paths if both exist, match and stay valid past ``now + margin``.

    ``None`` here means "make a new one", which is the normal first-start case, not a failure.
    """
    if not (cert_path.exists() and key_path.exists()):
        return None
    try:
        cert, key = _read_cert(cert_path), _read_key(key_path)
    except InvalidArgument:
        return None  # A damaged generated file is replaced rather than blocking the start.
    matches = cert.public_key() == key.public_key()
    valid = cert.not_valid_before_utc <= now and now + margin < cert.not_valid_after_utc
    return (cert, key) if matches and valid else None


def _fits(cert: x509.Certificate, ca_cert: x509.Certificate, names: list[x509.GeneralName]) -> bool:
    """Whether ``cert`` was signed by this CA and covers every requested name."""
    if cert.issuer != ca_cert.subject:
        return False
    try:
        cert.verify_directly_issued_by(ca_cert)
        present = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    return all(name in present for name in names)


# ---- files --------------------------------------------------------------------------------------------


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    # A fresh temporary file created with the final mode, then renamed: no moment where a key is readable
    # by others, and no reader ever sees half a file.
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(temporary, mode)  # the umask may have narrowed the certificate's mode
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write_atomically(path, data, _KEY_MODE)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    _write_atomically(path, cert.public_bytes(serialization.Encoding.PEM), _CERT_MODE)


def _read_pem(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"cannot read the TLS {what} {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise InvalidArgument(f"the TLS {what} {path} is not a PEM file")
    return data


def _parse_certs(path: Path, data: bytes) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise InvalidArgument(f"{path} holds no valid PEM certificate: {exc}") from None


def _read_cert(path: Path) -> x509.Certificate:
    return _parse_certs(path, _read_pem(path, "certificate"))[0]


def _read_key(path: Path) -> ec.EllipticCurvePrivateKey:
    data = _read_pem(path, "private key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"{path} holds no usable unencrypted PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidArgument(f"{path} is not an EC key (fedlink generates ECDSA P-256 keys)")
    return key


def _check_pair(cert_path: Path, cert_pem: bytes, key_path: Path, key_pem: bytes) -> None:
    """Fails early, naming the files, when the key does not belong to the certificate."""
    leaf = _parse_certs(cert_path, cert_pem)[0]
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"{key_path} holds no usable unencrypted PEM private key: {exc}") from None
    if leaf.public_key() != key.public_key():
        raise InvalidArgument(f"the private key {key_path} does not belong to the certificate {cert_path}")


__all__ = [
    "CA_VALIDITY",
    "CERT_VALIDITY",
    "RENEW_BEFORE",
    "TlsMaterial",
    "certificate_names",
    "ensure_self_signed",
    "host_names_and_addresses",
    "is_wildcard_address",
    "issue_client_certificate",
    "load_channel_credentials",
    "load_server_credentials",
]
