"""Alembic environment: fedlink runs migrations in code, on a connection it hands over."""

from __future__ import annotations

from alembic import context

from fedlink.server.store.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError(
        "fedlink migrations run through `fedlink db upgrade` (fedlink.server.store.migrate), "
        "not the alembic command line"
    )

# Batch mode lets later revisions alter SQLite tables (by copy-and-move); a no-op on PostgreSQL.
context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
