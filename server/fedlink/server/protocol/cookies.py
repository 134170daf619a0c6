"""Signed, opaque cookies that the coordinator hands to devices.

A cookie binds a device to a job and, once a task was handed out, to that assignment. It is signed with
HMAC-SHA256 under a key kept in the store, so cookies survive a coordinator restart and no device can
forge one or use another device's.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

from fedlink.common.errors import InvalidArgument, PermissionDenied

_MAC_BYTES = 32
_BLOCK = 64  # SHA-256's block size
_VERSION = 1
MAX_COOKIE_BYTES = 1024
#: One encoder for every cookie (``json.dumps`` with separators builds a new one per call).
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
#: And one decoder, given text: ``json.loads`` of bytes first sniffs their encoding (3x the time).
_DECODE = json.JSONDecoder().decode


@dataclass(frozen=True, slots=True, kw_only=True)
class Cookie:
    """What a cookie says."""

    device_id: str
    job_id: str
    assignment_id: str = ""


class CookieSigner:
    """Signs and verifies cookies with one key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a cookie key needs at least 16 bytes")
        # HMAC-SHA256 (RFC 2104) from the key's two padded states, hashed once here. hmac.digest
        # releases the GIL around each call: with the store's thread waiting for it, the event loop
        # then waited up to a switch interval to get it back, twice per device RPC. hashlib does not
        # release it for data this short.
        block = key if len(key) <= _BLOCK else hashlib.sha256(key).digest()
        block = block.ljust(_BLOCK, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def _mac(self, body: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(body)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()

    def sign(self, cookie: Cookie) -> bytes:
        """Returns the opaque bytes of ``cookie``."""
        body = _ENCODE([_VERSION, cookie.device_id, cookie.job_id, cookie.assignment_id]).encode()
        return body + self._mac(body)

    def verify(self, data: bytes, *, device_id: str, job_id: str) -> Cookie:
        """Checks ``data`` was signed here for this device and job, and returns what it says.

        Raises:
            InvalidArgument: the bytes are not a cookie of this coordinator (forged or corrupted).
            PermissionDenied: a genuine cookie of another device or job.
        """
        if len(data) > MAX_COOKIE_BYTES or len(data) <= _MAC_BYTES:
            raise InvalidArgument("the cookie is not one this coordinator issued")
        body, mac = data[:-_MAC_BYTES], data[-_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(body)):
            raise InvalidArgument("the cookie's signature does not match: this coordinator did not issue it")
        try:
            version, dev, job, assignment = _DECODE(body.decode())
        except (ValueError, TypeError) as exc:  # UnicodeDecodeError is a ValueError
            raise InvalidArgument("the cookie is malformed") from exc
        if version != _VERSION:
            raise InvalidArgument(f"cookie version {version} is not supported")
        if dev != device_id:
            raise PermissionDenied("the cookie belongs to another device")
        if job != job_id:
            raise InvalidArgument(f"the cookie is for job {job}, not {job_id}")
        return Cookie(device_id=dev, job_id=job, assignment_id=assignment)
