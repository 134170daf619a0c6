"""Enrolment: who may enrol, how many and how fast, and when a retried Enroll is answered again.

A device's id and credential are derived from its Enroll ``request_id`` with a coordinator secret, so
a retried enrolment (its reply was lost) can be answered without storing the credential. Answering
every later request with that id would hand the credential to anyone who learns the id, forever: a
retry is answered only within ``replay_window`` of the first request and only if it is the same
request (an HMAC of it is stored with the device); otherwise it gets ALREADY_EXISTS.

New devices are counted against ``max_devices`` (revoked ones do not count) and a token bucket of
``per_minute`` enrolments (``burst`` at once); both refusals are RESOURCE_EXHAUSTED with a
``retry_after``. Retries of an enrolment that exists are neither counted nor limited. With
``require_approval`` new devices are PENDING until an operator approves them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from fedlink.common.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
)
from fedlink.server.credentials import hash_credential
from fedlink.server.domain import Clock, DeviceState
from fedlink.server.store import StateStore

#: Most entries in an enrolment's ``device_info`` or ``user_info``.
MAX_INFO_ENTRIES: Final = 64
#: Most bytes of UTF-8 keys and values in an enrolment's ``device_info`` or ``user_info``: a listing of
#: a page of devices (ListDevices' default 50) then stays well within a 4 MiB gRPC message.
MAX_INFO_BYTES: Final = 16 * 1024
#: Shortest ``request_id``: it is the seed of the device's credential, so it must be random (a UUID).
MIN_REQUEST_ID_CHARS: Final = 16
#: Longest ``request_id`` kept (the store's column width elsewhere; a UUID is 36).
MAX_REQUEST_ID_CHARS: Final = 128
#: When a device refused by the cap may try again: the cap moves only when an operator acts.
CAP_RETRY_AFTER: Final = timedelta(minutes=5)


@dataclass(frozen=True, slots=True, kw_only=True)
class EnrolmentPolicy:
    """Who may enrol and how many (a slice of the coordinator's settings)."""

    #: The join secret enrolment needs; None means open enrolment.
    join_secret: str | None = None
    #: New devices are PENDING until an operator approves them.
    require_approval: bool = False
    #: Most enrolled devices that are not revoked; None: no cap.
    max_devices: int | None = None
    #: Enrolments per minute once the burst is spent; 0: no limit.
    per_minute: int = 0
    #: Enrolments that may come at once.
    burst: int = 1
    #: How long after the first Enroll a retry with the same request_id gets the credential again.
    replay_window: timedelta = timedelta(minutes=5)

    def __post_init__(self) -> None:
        if self.max_devices is not None and self.max_devices < 1:
            raise InvalidArgument("max_devices must be at least 1 (unset: no cap)")
        if self.per_minute < 0 or self.burst < 1:
            raise InvalidArgument("the enrolment rate must be >= 0 per minute with a burst of at least 1")
        if self.replay_window < timedelta(0):
            raise InvalidArgument("the enrolment replay window must not be negative")


@dataclass(frozen=True, slots=True, kw_only=True)
class Enrolment:
    """A device's identity and credential (the credential is only ever shown here)."""

    device_id: str
    credential: str
    #: ONLINE, or PENDING while it awaits an operator's approval.
    state: DeviceState = DeviceState.ONLINE


@dataclass(frozen=True, slots=True, kw_only=True)
class EnrolRequest:
    """What an Enroll call says (the identity it asks for is derived from ``request_id``)."""

    join_secret: str
    device_info: Mapping[str, str]
    user_info: Mapping[str, str]
    protocol_version: str
    request_id: str


class TokenBucket:
    """``per_minute`` events a minute, ``burst`` at once, on an injected clock (for tests)."""

    def __init__(self, *, per_minute: int, burst: int, clock: Clock) -> None:
        self._rate = per_minute / 60.0  # tokens per second
        self._burst = float(burst)
        self._clock = clock
        self._tokens = float(burst)
        self._at: datetime = clock.now()

    def take(self) -> timedelta | None:
        """Takes a token; None if there was one, else how long until there is (nothing is taken)."""
        if self._rate <= 0:
            return None
        now = self._clock.now()
        elapsed = max((now - self._at).total_seconds(), 0.0)
        self._tokens = min(self._burst, self._tokens + elapsed * self._rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return None
        return timedelta(seconds=(1.0 - self._tokens) / self._rate)


def check_info(name: str, info: Mapping[str, str]) -> None:
    """Refuses a ``device_info`` or ``user_info`` map over the entry or byte cap (INVALID_ARGUMENT)."""
    if len(info) > MAX_INFO_ENTRIES:
        raise InvalidArgument(f"{name} has {len(info)} entries; at most {MAX_INFO_ENTRIES} are kept")
    size = sum(len(key.encode()) + len(value.encode()) for key, value in info.items())
    if size > MAX_INFO_BYTES:
        raise InvalidArgument(
            f"{name} holds {size} bytes of keys and values; at most {MAX_INFO_BYTES} are kept"
        )


class Enrolments:
    """Enrols devices under an :class:`EnrolmentPolicy`."""

    def __init__(self, store: StateStore, *, key: bytes, clock: Clock, policy: EnrolmentPolicy) -> None:
        self._store = store
        self._key = key
        self._clock = clock
        self._policy = policy
        self._bucket = TokenBucket(per_minute=policy.per_minute, burst=policy.burst, clock=clock)

    async def enroll(self, request: EnrolRequest) -> Enrolment:
        """Enrols a device, or answers a retry of its enrolment again (see the module docstring).

        Raises:
            Unauthenticated: the join secret is wrong.
            InvalidArgument: a request_id that is not a random id, or an info map over its cap.
            AlreadyExists: the request_id was used by another request, or too long ago.
            ResourceExhausted: the device cap or the enrolment rate was reached (with retry_after).
        """
        policy = self._policy
        expected = policy.join_secret
        if expected is not None and not hmac.compare_digest(request.join_secret.encode(), expected.encode()):
            raise Unauthenticated("enrolment needs the coordinator's join secret")
        if not MIN_REQUEST_ID_CHARS <= len(request.request_id) <= MAX_REQUEST_ID_CHARS:
            raise InvalidArgument(
                f"request_id must be a random id of {MIN_REQUEST_ID_CHARS} to {MAX_REQUEST_ID_CHARS} "
                "characters (a UUID)"
            )
        check_info("device_info", request.device_info)
        check_info("user_info", request.user_info)
        seed = hmac.new(self._key, request.request_id.encode(), hashlib.sha256).hexdigest()
        device_id = "dev-" + seed[:24]
        credential = seed[24:] + hashlib.sha256(seed.encode()).hexdigest()
        digest = self._digest(request)
        replayed = await self._replay(device_id, credential, digest)
        if replayed is not None:
            return replayed
        wait = self._bucket.take()
        if wait is not None:
            raise ResourceExhausted(
                f"too many enrolments: at most {policy.per_minute} a minute; try again in "
                f"{wait.total_seconds():.1f}s",
                retry_after=wait,
            )
        try:
            device = await self._store.enroll_device(
                request.device_info,
                request.user_info,
                hash_credential(credential),
                device_id=device_id,
                pending=policy.require_approval,
                enrolment_digest=digest,
                max_devices=policy.max_devices,
            )
        except ResourceExhausted as exc:
            raise ResourceExhausted(exc.message, retry_after=CAP_RETRY_AFTER) from None
        except AlreadyExists:
            # The same request_id, enrolled by a concurrent call between our look and our insert.
            replayed = await self._replay(device_id, credential, digest)
            if replayed is None:  # pragma: no cover - a credential hash collision
                raise
            return replayed
        return Enrolment(device_id=device.device_id, credential=credential, state=device.state)

    def _digest(self, request: EnrolRequest) -> str:
        """An HMAC of everything the request says, so that "the same request" can be checked later."""
        canonical = json.dumps(
            [
                request.join_secret,
                sorted(request.device_info.items()),
                sorted(request.user_info.items()),
                request.protocol_version,
                request.request_id,
            ],
            separators=(",", ":"),
        )
        return hmac.new(self._key, b"enrolment request\0" + canonical.encode(), hashlib.sha256).hexdigest()

    async def _replay(self, device_id: str, credential: str, digest: str) -> Enrolment | None:
        """The answer to a retry of the enrolment of ``device_id``; None if there was none.

        Raises:
            AlreadyExists: the first request was another one, or is older than the replay window.
        """
        try:
            device = await self._store.get_device(device_id)
        except NotFound:
            return None
        stored = await self._store.enrolment_digest(device_id)
        if stored is None or not hmac.compare_digest(stored, digest):
            raise AlreadyExists(
                "this request_id was used by another enrolment request; enrol with a new random request_id"
            )
        if device.state is DeviceState.REVOKED:  # its credential is refused: replaying does not revive it
            raise Unauthenticated(f"device {device_id}, which this request enrolled, was revoked")
        window = self._policy.replay_window
        if self._clock.now() - device.enrolled_at > window:
            raise AlreadyExists(
                f"this request_id enrolled a device more than {window} ago, and its credential is not "
                "shown again; enrol with a new random request_id"
            )
        return Enrolment(device_id=device_id, credential=credential, state=device.state)


__all__ = [
    "CAP_RETRY_AFTER",
    "MAX_INFO_BYTES",
    "MAX_INFO_ENTRIES",
    "EnrolRequest",
    "Enrolment",
    "EnrolmentPolicy",
    "Enrolments",
    "TokenBucket",
    "check_info",
]
