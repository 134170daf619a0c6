"""The coordinator's state store: one SQLAlchemy implementation on SQLite or PostgreSQL.

``async with open_store(url) as store:`` gives a :class:`StateStore`; ``store.blobs`` is its
:class:`BlobStore`. Schema changes are Alembic migrations (``fedlink db upgrade``).
"""

from fedlink.server.store.blobs import SqlBlobStore
from fedlink.server.store.dialect import is_store_outage
from fedlink.server.store.migrate import current_revision, downgrade, head_revision, upgrade
from fedlink.server.store.protocol import (
    CHUNK_SIZE,
    BlobRef,
    BlobStore,
    ClaimRequest,
    NewJob,
    NewTask,
    Page,
    RecordOutcome,
    ResultReport,
    StateStore,
    all_items,
)
from fedlink.server.store.sql import SqlStateStore, create_store, open_store

__all__ = [
    "CHUNK_SIZE",
    "BlobRef",
    "BlobStore",
    "ClaimRequest",
    "NewJob",
    "NewTask",
    "Page",
    "RecordOutcome",
    "ResultReport",
    "SqlBlobStore",
    "SqlStateStore",
    "StateStore",
    "all_items",
    "create_store",
    "current_revision",
    "downgrade",
    "head_revision",
    "is_store_outage",
    "open_store",
    "upgrade",
]
