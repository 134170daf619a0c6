"""Identifiers: random UUID4 hex strings, 32 lowercase characters."""

from __future__ import annotations

import uuid


def new_id() -> str:
    """Return a fresh random identifier (uuid4 hex)."""
    return uuid.uuid4().hex
