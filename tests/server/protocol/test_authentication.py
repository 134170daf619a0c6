"""Device authentication against a real SQLite store: concurrent checks share reads, none is cached."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fedlink.common.errors import Unauthenticated
from fedlink.server.credentials import hash_credential
from fedlink.server.domain import Device, ManualClock
from fedlink.server.protocol.authentication import DeviceAuthenticator
from fedlink.server.store import SqlStateStore, open_store


@dataclass
class Reads:
    """The batched credential reads the store served; ``hold`` keeps a read's answers back once it ran."""

    batches: list[list[str]] = field(default_factory=list)
    hold: asyncio.Event | None = None
    #: Set once a read ran.
    ran: asyncio.Event = field(default_factory=asyncio.Event)


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqlStateStore]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'fedlink.db'}"
    async with open_store(url, clock=ManualClock(), auto_migrate=True) as opened:
        yield opened


@pytest.fixture
def reads(store: SqlStateStore, monkeypatch: pytest.MonkeyPatch) -> Reads:
    """Records every ``authenticate_devices`` read of ``store`` (the real one runs)."""
    seen = Reads()
    real = store.authenticate_devices

    async def observed(credential_hashes: Sequence[str]) -> list[Device | Unauthenticated]:
        answers = await real(credential_hashes)
        seen.batches.append(list(credential_hashes))
        seen.ran.set()
        if seen.hold is not None:
            await seen.hold.wait()
        return answers

    monkeypatch.setattr(store, "authenticate_devices", observed)
    return seen


async def enrol(store: SqlStateStore, credential: str) -> Device:
    return await store.enroll_device({}, {}, hash_credential(credential))


async def test_concurrent_calls_share_reads_and_get_their_own_answers(
    store: SqlStateStore, reads: Reads
) -> None:
    devices = {f"cred-{i}": await enrol(store, f"cred-{i}") for i in range(40)}
    await store.revoke_device(devices["cred-7"].device_id)
    auth = DeviceAuthenticator(store)
    asked = [*devices, "cred-unknown", "", "cred-3"]
    answers = await asyncio.gather(*(auth.device(c) for c in asked), return_exceptions=True)
    for credential, answer in zip(asked, answers, strict=True):
        if credential in ("cred-7", "cred-unknown", ""):
            assert isinstance(answer, Unauthenticated), credential
        else:
            assert answer == devices[credential]
    assert len(reads.batches) <= 2, "calls that arrive together should be checked by one read"
    assert sorted(h for read in reads.batches for h in read) == sorted(
        hash_credential(c)
        for c in asked
        if c  # an empty credential is refused without a read
    )


async def test_a_revocation_bites_the_next_call(store: SqlStateStore, reads: Reads) -> None:
    device = await enrol(store, "cred")
    auth = DeviceAuthenticator(store)
    assert await auth.device("cred") == device
    await store.revoke_device(device.device_id)
    with pytest.raises(Unauthenticated, match="revoked"):
        await auth.device("cred")
    assert len(reads.batches) == 2


async def test_a_call_arriving_after_a_revocation_is_not_answered_by_an_earlier_read(
    store: SqlStateStore, reads: Reads
) -> None:
    device = await enrol(store, "cred")
    auth = DeviceAuthenticator(store)
    reads.hold = asyncio.Event()
    early = asyncio.create_task(auth.device("cred"))
    await reads.ran.wait()  # the early call's read ran; its answer is held back
    await store.revoke_device(device.device_id)
    late = asyncio.create_task(auth.device("cred"))
    await asyncio.sleep(0)  # it asks while the early read is still answering
    reads.hold.set()
    assert await early == device  # read before the revocation, as a read per call would have been
    with pytest.raises(Unauthenticated, match="revoked"):
        await late
    assert len(reads.batches) == 2
