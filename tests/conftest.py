"""Fixtures shared by the whole suite: where the checkout and the test interpreter's scripts are."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import hypothesis  # noqa: F401  (see below)
import pytest

# Imported up front: hypothesis's pytest plugin imports it at the end of the session when no test did,
# and on CPython 3.11.7 compiling it then failed with "AST constructor recursion depth mismatch" (left
# by an earlier RecursionError in the run), ending a run of a subset of the suite with a traceback
# instead of its summary.

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    # bench/ holds scripts run from the repository root (python -m bench.X), not an installed package.
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The root of the checkout under test."""
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def venv_bin() -> Path:
    """The scripts folder of the interpreter running the tests (its console scripts, buf, ...)."""
    # Not resolved: the venv's python is a symlink to the base interpreter, whose folder is not the venv's.
    return Path(sys.executable).parent


@pytest.fixture
def pg_database() -> Iterator[str]:
    """A throwaway, empty PostgreSQL database for one test (dropped afterwards).

    Without a reachable server the test is skipped loudly, or fails when ``CI`` is set.
    """
    import asyncpg

    from fedlink.server.store.testing import create_pg_database, drop_pg_database

    base = os.environ.get("FEDLINK_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test")
    try:
        url = create_pg_database(base)
    except (OSError, asyncpg.PostgresError) as exc:
        message = f"PostgreSQL at {base} is unreachable ({exc!r}); this test did not run"
        if os.environ.get("CI"):
            pytest.fail(message)
        print(f"\n*** SKIPPING: {message} ***", file=sys.stderr)
        pytest.skip(message)
    try:
        yield url
    finally:
        drop_pg_database(base, url)
