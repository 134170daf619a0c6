"""What every part of the SQL store shares: the database, the clock, and lookups that raise NotFound."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.common.errors import NotFound
from fedlink.server.domain import Clock
from fedlink.server.store.dialect import Database


class StoreCore:
    """The state every query group of :class:`~fedlink.server.store.sql.SqlStateStore` works with."""

    def __init__(self, database: Database, clock: Clock) -> None:
        self._db = database
        self._clock = clock

    @staticmethod
    async def _fetch_one(conn: AsyncConnection, query: sa.Select[Any], what: str) -> sa.Row[Any]:
        row: sa.Row[Any] | None = (await conn.execute(query)).first()
        if row is None:
            raise NotFound(f"{what} does not exist")
        return row
