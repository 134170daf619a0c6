"""Cookies are bound to a device and job and cannot be forged."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from fedlink.common.errors import InvalidArgument, PermissionDenied
from fedlink.server.protocol.cookies import Cookie, CookieSigner

KEY = b"k" * 32


def test_round_trip() -> None:
    signer = CookieSigner(KEY)
    cookie = Cookie(device_id="d1", job_id="j1", assignment_id="a1")
    assert signer.verify(signer.sign(cookie), device_id="d1", job_id="j1") == cookie


def test_a_cookie_signed_with_another_key_is_refused() -> None:
    data = CookieSigner(b"x" * 32).sign(Cookie(device_id="d1", job_id="j1"))
    with pytest.raises(InvalidArgument, match="signature"):
        CookieSigner(KEY).verify(data, device_id="d1", job_id="j1")


def test_a_tampered_cookie_is_refused() -> None:
    signer = CookieSigner(KEY)
    data = bytearray(signer.sign(Cookie(device_id="d1", job_id="j1", assignment_id="a1")))
    data[5] ^= 1
    with pytest.raises(InvalidArgument):
        signer.verify(bytes(data), device_id="d1", job_id="j1")


@pytest.mark.parametrize("data", [b"", b"short", b"x" * 5000])
def test_garbage_is_refused(data: bytes) -> None:
    with pytest.raises(InvalidArgument):
        CookieSigner(KEY).verify(data, device_id="d1", job_id="j1")


def test_another_devices_cookie_is_permission_denied() -> None:
    signer = CookieSigner(KEY)
    data = signer.sign(Cookie(device_id="d2", job_id="j1"))
    with pytest.raises(PermissionDenied):
        signer.verify(data, device_id="d1", job_id="j1")


def test_a_cookie_for_another_job_is_refused() -> None:
    signer = CookieSigner(KEY)
    data = signer.sign(Cookie(device_id="d1", job_id="j2"))
    with pytest.raises(InvalidArgument, match="j2"):
        signer.verify(data, device_id="d1", job_id="j1")


@pytest.mark.parametrize("key_bytes", [16, 32, 64, 65, 200])
def test_the_mac_is_standard_hmac_sha256_for_any_key_length(key_bytes: int) -> None:
    key = hashlib.shake_256(b"cookie key").digest(key_bytes)  # longer than a block: hashed first
    cookie = CookieSigner(key).sign(Cookie(device_id="d", job_id="j", assignment_id="a"))
    body, mac = cookie[:-32], cookie[-32:]
    assert mac == hmac.digest(key, body, "sha256")
