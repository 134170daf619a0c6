"""Proof of possession: which devices hold which blobs (``blob_grants``).

Blobs are content-addressed and stored once, so knowing a sha256 must not be worth anything to a
device: it holds a blob only once it uploaded the whole bytes itself (their hash checked), or when
the blob is the input of a task it was handed (the rule :meth:`RoundQueries.device_may_read_blob`
applies to downloads). A grant goes with its blob (a foreign key with ON DELETE CASCADE), whether
the blob is deleted or garbage-collected.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.server.store.rounds import RoundQueries
from fedlink.server.store.schema import UtcDateTime, blob_grants, blobs

_COLUMNS = ["sha256", "device_id", "created_at"]


def _granted(device_id: str, sha256: str) -> sa.Select[Any]:
    return sa.select(sa.literal(1)).where(
        blob_grants.c.sha256 == sha256, blob_grants.c.device_id == device_id
    )


class BlobGrantQueries(RoundQueries):
    """Grants of blobs to the devices that proved they hold them."""

    async def grant_blob(self, sha256: str, device_id: str) -> bool:
        """Record that the device proved it holds the stored blob (idempotent).

        Returns False, recording nothing, if the blob is not stored (e.g. collected meanwhile).
        """
        now = sa.literal(self._clock.now(), UtcDateTime())
        source = sa.select(blobs.c.sha256, sa.literal(device_id, sa.String()), now).where(
            blobs.c.sha256 == sha256
        )
        insert = self._db.insert_ignore(blob_grants).from_select(_COLUMNS, source)

        async def work(conn: AsyncConnection) -> bool:
            await conn.execute(insert)
            return (await conn.execute(_granted(device_id, sha256))).first() is not None

        return await self._db.write(work)

    async def device_holds_blob(self, device_id: str, sha256: str) -> bool:
        """True if the blob is stored and the device uploaded it or may read it as a task's input."""
        async with self._db.read() as conn:
            if (await conn.execute(_granted(device_id, sha256))).first() is not None:
                return True  # a grant's blob is stored: the grant goes with it
            stored = sa.select(sa.literal(1)).where(blobs.c.sha256 == sha256)
            if (await conn.execute(stored)).first() is None:
                return False
        return await self.device_may_read_blob(device_id, sha256)
