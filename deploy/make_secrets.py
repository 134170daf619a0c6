"""Writes the secret files of deploy/compose.yaml into a folder (default: deploy/secrets/).

    python deploy/make_secrets.py [--out DIR] [--hostname NAME ...]

Needs the server extra (``pip install 'fedlink[server]'``: it uses fedlink's own certificate code). It
writes, keeping any file that already exists (delete one to make it anew):

======================  ===========================================================================
``join-secret``         what runners present to enrol (0600)
``admin-token``         the operator's credential for ``fedlink job`` / ``fedlink device`` (0600)
``postgres-password``   the PostgreSQL password of the ``fedlink`` role (0600)
``grafana-admin-password``  Grafana's ``admin`` password (0600)
``ca.pem``, ``ca.key``  a CA for this deployment (the key 0600: keep it to issue more certificates)
``server.pem/.key``     the certificate every coordinator replica presents, signed by that CA, for the
                        given host names (compose's two replicas: ``coordinator`` and ``coordinator-2``)
======================  ===========================================================================

A ``server.pem`` that does not cover every name asked for (one written before a name was added) is
issued anew, with its key, from the same CA; runners keep trusting ``ca.pem``.

Compose bind-mounts each secret file with the host's owner and mode, so the 0600 files must belong to
the container user that reads them: uid 10001 (fedlink's images) and 472 (Grafana's). The script prints
the ``chown`` commands; run as root, ``--chown`` does it.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Final

from cryptography import x509

from fedlink.server.tls import ensure_self_signed

#: The names compose's services reach the coordinator replicas by, and a container's own loopback (its
#: HEALTHCHECK, and the host's published ports).
DEFAULT_HOSTNAMES: Final = ("coordinator", "coordinator-2", "localhost", "127.0.0.1")
#: Secret files and how many random bytes each holds (hex: safe inside a database URL).
_TOKENS: Final = {"join-secret": 32, "admin-token": 32, "postgres-password": 24, "grafana-admin-password": 16}
#: Who reads each private file inside its container: fedlink's user (10001), Grafana's (472). PostgreSQL
#: reads its password as root before dropping privileges, but the coordinator reads it too.
OWNERS: Final = {
    "join-secret": 10001,
    "admin-token": 10001,
    "postgres-password": 10001,
    "server.key": 10001,
    "grafana-admin-password": 472,
}


def _write_new(path: Path, text: str) -> bool:
    """Creates ``path`` 0600 with ``text`` unless it exists; returns whether it wrote."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as file:
        file.write(text)
    return True


def covers(certificate: Path, hostnames: tuple[str, ...]) -> bool:
    """Whether the PEM ``certificate`` names every one of ``hostnames`` (DNS names or IP addresses)."""
    cert = x509.load_pem_x509_certificate(certificate.read_bytes())
    try:
        present = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    names = set(present.get_values_for_type(x509.DNSName)) | set(present.get_values_for_type(x509.IPAddress))
    return all(_general_name(host) in names for host in hostnames)


def _general_name(host: str) -> str | ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return host


def make_secrets(out: Path, hostnames: tuple[str, ...] = DEFAULT_HOSTNAMES) -> list[Path]:
    """Writes the missing secret files into ``out``; returns the files it wrote.

    A server certificate that does not cover ``hostnames`` is replaced, with its key, by one the same CA
    issues for them.
    """
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    written = [
        out / name for name, size in _TOKENS.items() if _write_new(out / name, secrets.token_hex(size))
    ]
    ca = {"ca.pem": "ca_cert_path", "ca.key": "ca_key_path"}
    server = {"server.pem": "cert_path", "server.key": "key_path"}
    complete = all((out / name).exists() for name in ca | server)
    if complete and covers(out / "server.pem", hostnames):
        return written
    # fedlink's self-signed material (ECDSA P-256, the CA for 10 years), made in a scratch folder so that
    # a partial set in ``out`` is replaced whole. A complete set keeps its CA and gets a new server pair
    # (the old key is never read: it may already belong to the container's user).
    with tempfile.TemporaryDirectory() as scratch:
        tls = Path(scratch) / "tls"
        if complete:
            tls.mkdir(mode=0o700)
            for name in ca:
                shutil.copy2(out / name, tls / name)
        material = ensure_self_signed(tls, hostnames)
        for name, attribute in (ca | server).items():
            source: Path = getattr(material, attribute)
            target = out / name
            if complete and name in ca and source.read_bytes() == target.read_bytes():
                continue  # the CA runners already trust (a new one only if it expired)
            # A new name, then a rename: a reader never sees half a file, and a file that belonged to
            # another user (chowned for its container) is replaced, not written through.
            partial = out / f".{name}.new"
            partial.unlink(missing_ok=True)
            shutil.copy2(source, partial)  # keeps 0600 for the keys, 0644 for the certificates
            partial.replace(target)
            written.append(target)
    return written


def main() -> int:
    """Writes the files and says what to do next."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "secrets")
    parser.add_argument(
        "--hostname",
        action="append",
        help=f"a name the server certificate covers (repeatable; default: {', '.join(DEFAULT_HOSTNAMES)})",
    )
    parser.add_argument("--chown", action="store_true", help="give each private file to its reader (root)")
    args = parser.parse_args()
    hostnames = tuple(args.hostname) if args.hostname else DEFAULT_HOSTNAMES
    try:
        written = make_secrets(args.out, hostnames)
    except PermissionError as exc:
        # A new server certificate needs ca.key; a folder chowned whole to the containers' user hides it.
        print(f"error: {exc.strerror}: {exc.filename}: run this as its owner, or root", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    for uid in sorted(set(OWNERS.values())):
        files = [args.out / name for name, owner in OWNERS.items() if owner == uid]
        if args.chown:
            for path in files:
                os.chown(path, uid, uid)
        else:
            print(f"sudo chown {uid}:{uid} {' '.join(str(path) for path in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
