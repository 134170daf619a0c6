"""The SQL store implements every method of the StateStore and BlobStore protocols (checked by mypy too)."""

from __future__ import annotations

import inspect

import pytest

from fedlink.server.store import BlobStore, SqlBlobStore, SqlStateStore, StateStore


def _typed_conformance(state: SqlStateStore, blobs: SqlBlobStore) -> tuple[StateStore, BlobStore]:
    # mypy --strict fails here if the implementation drifts from a protocol's signatures.
    return state, blobs


def _protocol_members(protocol: type) -> set[str]:
    return {name for name, _ in inspect.getmembers(protocol) if not name.startswith("_")}


@pytest.mark.parametrize(
    ("protocol", "implementation"), [(StateStore, SqlStateStore), (BlobStore, SqlBlobStore)]
)
def test_implementation_has_every_protocol_member(protocol: type, implementation: type) -> None:
    missing = _protocol_members(protocol) - set(dir(implementation))
    assert not missing, f"{implementation.__name__} lacks {sorted(missing)}"
    for name in _protocol_members(protocol):
        expected = inspect.signature(getattr(protocol, name)) if callable(getattr(protocol, name)) else None
        if expected is not None:
            actual = inspect.signature(getattr(implementation, name))
            assert list(actual.parameters) == list(expected.parameters), name
