"""Contract: the cookie signing key survives restarts; idempotency records keep the first reply."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from fedlink.server.domain import ManualClock
from fedlink.server.store import SqlStateStore, open_store
from fedlink.server.store.testing import StoreFactory


async def test_signing_key_is_created_once(store: SqlStateStore, more_stores: StoreFactory) -> None:
    others = [await more_stores() for _ in range(4)]
    keys = await asyncio.gather(*(s.get_or_create_signing_key() for s in [store, *others]))
    assert len(keys[0]) == 32
    assert len(set(keys)) == 1


@pytest.mark.parametrize("backend", ["sqlite-file", "postgres"], indirect=True)
async def test_signing_key_survives_reopen(store_url: str, clock: ManualClock) -> None:
    async with open_store(store_url, clock=clock, auto_migrate=True) as store:
        key = await store.get_or_create_signing_key()
    async with open_store(store_url, clock=clock, auto_migrate=True) as store:
        assert await store.get_or_create_signing_key() == key


async def test_remember_and_recall_replies(store: SqlStateStore, clock: ManualClock) -> None:
    assert await store.recall_reply("ReportResult", "req-1") is None
    assert await store.remember_reply("ReportResult", "req-1", b"first") == b"first"
    # A racing retry that computed its own reply gets the first one back.
    assert await store.remember_reply("ReportResult", "req-1", b"second") == b"first"
    assert await store.recall_reply("ReportResult", "req-1") == b"first"
    assert await store.recall_reply("SubmitJob", "req-1") is None
    clock.advance(timedelta(days=2))
    assert await store.forget_replies(clock.now()) == 1
    assert await store.recall_reply("ReportResult", "req-1") is None
