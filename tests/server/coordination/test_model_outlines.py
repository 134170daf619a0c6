"""Model outlines from the real blob store: a stored DXO's spec learnt by streaming, checked and cached."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from fedlink.common.dxo import DXO, DataKind
from fedlink.common.errors import InvalidArgument, NotFound
from fedlink.server.coordination.model_outlines import ModelOutlines
from fedlink.server.domain import ManualClock
from fedlink.server.domain.updates import model_spec
from fedlink.server.store import CHUNK_SIZE, SqlStateStore, open_store


@pytest.fixture(params=["directory", "database"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SqlStateStore]:
    """A SQLite store keeping blob bytes in a directory, or in the database."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'fedlink.db'}"
    blob_dir = tmp_path / "blobs" if request.param == "directory" else None
    async with open_store(
        url, clock=ManualClock(), auto_migrate=True, blob_dir=blob_dir, blobs_in_database=blob_dir is None
    ) as opened:
        yield opened


def model() -> DXO:
    rng = np.random.default_rng(0)
    return DXO(
        kind=DataKind.WEIGHTS,
        data={
            # Larger than the reader's seek threshold and several store chunks: jumped over.
            "big": rng.standard_normal(3 * CHUNK_SIZE).astype(np.float32),
            "w": rng.standard_normal((4, 3)).astype(np.float64),
            "b": np.arange(3, dtype=np.int32),
        },
        meta={"model_version": 0},
    )


async def test_the_spec_is_the_decoded_models_spec(store: SqlStateStore) -> None:
    data = model().to_bytes()
    ref = await store.blobs.put_bytes(data)
    outlines = ModelOutlines(store.blobs)
    assert await outlines.spec(ref.sha256) == model_spec(DXO.from_bytes(data).data)
    outline = await outlines.outline(ref.sha256)
    assert outline.kind is DataKind.WEIGHTS and outline.meta == {"model_version": 0}


async def test_an_outline_is_read_once_and_kept(store: SqlStateStore) -> None:
    ref = await store.blobs.put_bytes(model().to_bytes())
    outlines = ModelOutlines(store.blobs)
    first = await outlines.outline(ref.sha256)
    await store.blobs.delete(ref.sha256)  # the content never changes: the kept outline still answers
    assert await outlines.outline(ref.sha256) is first


async def test_a_failed_read_is_not_kept(store: SqlStateStore) -> None:
    data = model().to_bytes()
    outlines = ModelOutlines(store.blobs, cache_size=2)
    sha = hashlib.sha256(data).hexdigest()
    with pytest.raises(NotFound):
        await outlines.outline(sha)
    await store.blobs.put_bytes(data)
    assert (await outlines.outline(sha)).tensors["b"].shape == (3,)


async def test_a_blob_that_is_no_dxo_is_refused(store: SqlStateStore) -> None:
    bad = DXO(kind=DataKind.WEIGHTS, data={"w": np.ones(4, np.float32)}).to_bytes()[:-3]
    ref = await store.blobs.put_bytes(bad)
    with pytest.raises(InvalidArgument, match=r"not a valid fedlink\.v1\.Dxo"):
        await ModelOutlines(store.blobs).outline(ref.sha256)
