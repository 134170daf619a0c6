"""What BlobIntegrity remembers: a blob is hashed once however many read it at once, a bad one is refused
without hashing again for a while and then checked anew, and only so many good ones are kept."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from fedlink.common.errors import DataLoss
from fedlink.server.store.integrity import BlobIntegrity

DATA = b"a model"
SHA = hashlib.sha256(DATA).hexdigest()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_concurrent_readers_share_one_hashing_and_a_cancelled_one_hands_it_over() -> None:
    integrity = BlobIntegrity()
    runs: list[int] = []
    release = asyncio.Event()

    async def verify() -> None:
        runs.append(1)
        await release.wait()
        integrity.judge(SHA, len(DATA), hashlib.sha256(DATA).hexdigest(), len(DATA))

    first = asyncio.create_task(integrity.check(SHA, verify))
    others = [asyncio.create_task(integrity.check(SHA, verify)) for _ in range(5)]
    await asyncio.sleep(0.01)
    first.cancel()  # the reader that hashes goes away: one of the waiting ones hashes instead
    await asyncio.sleep(0.01)
    release.set()
    await asyncio.gather(*others)
    assert len(runs) == 2, "the blob was hashed more than once per hand-over"
    assert integrity.known_good(SHA)
    await integrity.check(SHA, verify)
    assert len(runs) == 2, "a blob known good was hashed again"


async def test_a_bad_blob_is_refused_without_hashing_then_checked_again() -> None:
    clock = Clock()
    told: list[str] = []
    integrity = BlobIntegrity(recheck_after_seconds=60, monotonic=clock)
    integrity.listeners.append(lambda sha, message: told.append(sha))
    hashed: list[bytes] = []
    stored = [b"a mode!"]

    async def verify() -> None:
        hashed.append(stored[0])
        integrity.judge(SHA, len(DATA), hashlib.sha256(stored[0]).hexdigest(), len(stored[0]))

    with pytest.raises(DataLoss, match=f"blob {SHA} is corrupted: its 7 bytes hash to"):
        await integrity.check(SHA, verify)
    clock.now += 59
    with pytest.raises(DataLoss):
        await integrity.check(SHA, verify)
    assert len(hashed) == 1 and told == [SHA]
    stored[0] = DATA  # restored from a backup
    clock.now += 2
    await integrity.check(SHA, verify)
    assert len(hashed) == 2 and integrity.known_good(SHA)


def test_only_the_newest_good_blobs_are_remembered() -> None:
    integrity = BlobIntegrity(remembered=2)
    shas = [hashlib.sha256(bytes([i])).hexdigest() for i in range(3)]
    for sha in shas:
        integrity.judge(sha, 1, sha, 1)
    assert [integrity.known_good(sha) for sha in shas] == [False, True, True]


def test_sizes_are_judged_before_hashes() -> None:
    integrity = BlobIntegrity()
    with pytest.raises(DataLoss, match="holds 5 bytes, not the 7 stored for it \\(truncated\\)"):
        integrity.judge(SHA, 7, SHA, 5)
    with pytest.raises(DataLoss, match="bytes added"):
        integrity.judge(SHA, 7, SHA, 9)
