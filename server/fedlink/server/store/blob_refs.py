"""What keeps a blob alive: the rows that point at it, and the upload keys that name their owner.

A blob is in use while a job (its initial model), a run (its global model or workflow state), a task
(its payload), a result (its payload) or a checkpoint (model or workflow state) points at it. None of
those columns has an index, so "which of these blobs are in use" is asked set-wise, one query per
column for a batch of hashes (one pass over each table), never as a correlated ``NOT EXISTS`` per
blob (one pass per blob on SQLite).

Upload keys (``blob_uploads.upload_key``, and the key the bytes are kept under meanwhile):

* ``up-<sha256>``: the upload of a blob by anyone (the ControlService's model uploads);
* ``ud-<owner>-<digest>``: a device's own upload, in flight;
* ``uh-<owner>-<digest>``: a device's complete upload it has not used yet (no bytes are kept under
  it: the blob holds them). It goes when the device reports the blob as an accepted result, or when
  it is collected, and until then it counts against the device's upload quota with the uploads in
  flight.

``<owner>`` is the device id (any other owner: a digest of it), so a device's uploads are found by
prefix; neither key can be mistaken for a sha256 (the bytes of one live under ``uploads/``, never
``objects/``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from fedlink.server.store.schema import among, checkpoints, jobs, results, runs, tasks

#: Every column that keeps a blob in use.
REFERENCES: tuple[sa.Column[str], ...] = (
    jobs.c.initial_model_sha256,
    runs.c.global_model_sha256,
    runs.c.workflow_state_sha256,
    tasks.c.payload_sha256,
    results.c.payload_sha256,
    checkpoints.c.model_sha256,
    checkpoints.c.workflow_state_sha256,
)
#: Hashes per reference query (below SQLite's 32,766 bound parameters; PostgreSQL binds one array).
_BATCH = 10_000
_DEVICE_ID = re.compile(r"[0-9a-f]{1,32}")


async def referenced_among(conn: AsyncConnection, sha256s: Iterable[str], *, array: bool) -> set[str]:
    """Those of ``sha256s`` that some row points at (one pass over each table per 10,000 hashes)."""
    wanted = sorted(set(sha256s))
    found: set[str] = set()
    for start in range(0, len(wanted), _BATCH):
        batch = wanted[start : start + _BATCH]
        for column in REFERENCES:
            query = sa.select(column).where(among(column, "sha256s", array=array)).distinct()
            found.update(sha for sha in (await conn.execute(query, {"sha256s": batch})).scalars() if sha)
    return found


def owner_tag(owner: str) -> str:
    """How an upload key names its owner: a device id as it is, anything else by a digest."""
    return owner if _DEVICE_ID.fullmatch(owner) else hashlib.sha256(owner.encode()).hexdigest()[:32]


def _owner_digest(owner: str, sha256: str) -> str:
    return hashlib.sha256(f"{owner}\n{sha256}".encode()).hexdigest()[:40]


def upload_key(sha256: str, owner: str | None = None) -> str:
    """The key of an upload of ``sha256``: anyone's, or the owner's own (resumed by it alone)."""
    if owner is None:
        return f"up-{sha256}"
    return f"ud-{owner_tag(owner)}-{_owner_digest(owner, sha256)}"


def held_key(sha256: str, owner: str) -> str:
    """The key that marks the owner's complete upload of ``sha256`` as not used yet."""
    return f"uh-{owner_tag(owner)}-{_owner_digest(owner, sha256)}"


def owned_keys(column: sa.ColumnElement[str], owner: str) -> sa.ColumnElement[bool]:
    """The condition "the upload key in ``column`` is one of the owner's (in flight or held)"."""
    tag = owner_tag(owner)
    return sa.or_(
        column.startswith(f"ud-{tag}-", autoescape=True), column.startswith(f"uh-{tag}-", autoescape=True)
    )


def is_held_key(key: str) -> bool:
    """Whether ``key`` marks a complete upload not used yet (no bytes are kept under it)."""
    return key.startswith("uh-")


def held_keys(reports: Iterable[tuple[str, str]]) -> list[str]:
    """The held-upload keys of ``(sha256, device_id)`` pairs."""
    return sorted({held_key(sha, device) for sha, device in reports})
