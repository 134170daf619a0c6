"""The coordinator's state store: one SQLAlchemy implementation on SQLite or PostgreSQL.

``async with open_store(url) as store:`` gives a :class:`StateStore`; ``store.blobs`` is its
:class:`BlobStore`. Schema changes are Alembic migrations (``fedlink db upgrade``).
"""

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
)

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
    "StateStore",
]
