"""The coordinator's state store: one SQLAlchemy implementation on SQLite or PostgreSQL.

``async with open_store(url) as store:`` gives a :class:`StateStore`; ``store.blobs`` is its
:class:`BlobStore`. Schema changes are Alembic migrations (``fedlink db upgrade``).

The protocol (:class:`StateStore`, :class:`NewTask`, ...) is imported at once; the SQL implementation
(SQLAlchemy and Alembic: the server extra) on first use of one of its names. The workflows import the
protocol, and the operator CLI the workflows' parameters: ``fedlink job`` works without the extra.
"""

from typing import TYPE_CHECKING

from fedlink.server.store.protocol import (
    CHUNK_SIZE,
    BlobRef,
    BlobStore,
    ClaimRequest,
    CollectedBlobs,
    NewJob,
    NewTask,
    Page,
    RecordOutcome,
    ResultReport,
    StateStore,
    UploadQuota,
    all_items,
)

if TYPE_CHECKING:
    from fedlink.server.store.blobs import SqlBlobStore
    from fedlink.server.store.dialect import is_store_outage
    from fedlink.server.store.migrate import current_revision, downgrade, head_revision, upgrade
    from fedlink.server.store.outages import StoreRetryPolicy, StoreUnavailable, is_connection_loss
    from fedlink.server.store.sql import SqlStateStore, create_store, open_store

#: The modules of the SQL implementation, imported by __getattr__ on first use (add new ones here too).
_SQL_MODULES = ("blobs", "dialect", "migrate", "outages", "sql")


if not TYPE_CHECKING:  # mypy sees the imports above; a __getattr__ would hide misspelt names from it

    def __getattr__(name: str) -> object:
        """Imports the SQL implementation on first use of one of its names (PEP 562)."""
        if name in __all__:
            import importlib

            for module in _SQL_MODULES:
                value = getattr(importlib.import_module(f"{__name__}.{module}"), name, _MISSING)
                if value is not _MISSING:
                    globals()[name] = value
                    return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_MISSING = object()

__all__ = [
    "CHUNK_SIZE",
    "BlobRef",
    "BlobStore",
    "ClaimRequest",
    "CollectedBlobs",
    "NewJob",
    "NewTask",
    "Page",
    "RecordOutcome",
    "ResultReport",
    "SqlBlobStore",
    "SqlStateStore",
    "StateStore",
    "StoreRetryPolicy",
    "StoreUnavailable",
    "UploadQuota",
    "all_items",
    "create_store",
    "current_revision",
    "downgrade",
    "head_revision",
    "is_connection_loss",
    "is_store_outage",
    "open_store",
    "upgrade",
]
