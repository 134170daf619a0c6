"""Fixtures shared by the whole suite: where the checkout and the test interpreter's scripts are, and
the background load of ``FEDLINK_TEST_LOAD``."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
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

from bench.orphans import tied  # noqa: E402  (needs the path above)

#: How many CPU-bound processes run beside the session (the process tests must pass on a loaded machine).
LOAD_VARIABLE = "FEDLINK_TEST_LOAD"
#: pytest-timeout's ceiling for a ``slow`` test that sets none (pyproject's 120 s is for in-process
#: tests). A process test waits for what it needs with deadlines of its own, far beyond normal; this
#: only ends a hang, and must not end a slow start on a loaded machine first.
SLOW_TEST_TIMEOUT_S = 600


def _background_load() -> int:
    value = os.environ.get(LOAD_VARIABLE, "").strip() or "0"
    try:
        count = int(value)
    except ValueError:
        raise pytest.UsageError(f"{LOAD_VARIABLE}={value!r}: expected a number of busy processes") from None
    if count < 0:
        raise pytest.UsageError(f"{LOAD_VARIABLE}={value!r}: expected a number of busy processes")
    return count


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Gives every ``slow`` test without a ``timeout`` marker of its own the slow tests' ceiling, and
    skips the ``not_under_load`` ones when the session runs beside a background load."""
    loaded = _background_load() > 0
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))
        if loaded and item.get_closest_marker("not_under_load") is not None:
            item.add_marker(pytest.mark.skip(reason=f"not beside {LOAD_VARIABLE}'s busy processes"))


def pytest_report_header(config: pytest.Config) -> str | None:
    """Says when the session runs beside a background load."""
    count = _background_load()
    return f"{LOAD_VARIABLE}={count}: {count} CPU-bound processes run beside the tests" if count else None


@pytest.fixture(scope="session", autouse=True)
def background_load() -> Iterator[int]:
    """``FEDLINK_TEST_LOAD=N``: N CPU-bound processes, each a core's worth of busy loop, for the whole
    session (a machine loaded by other work); they die with the session, however it ends."""
    busy = [
        subprocess.Popen(
            tied([sys.executable, "-c", "while True: pass"]),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        for _ in range(_background_load())
    ]
    try:
        yield len(busy)
    finally:
        for process in busy:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The root of the checkout under test."""
    return ROOT


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


@contextlib.contextmanager
def _closed_ports(count: int) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        addresses = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            addresses.append(f"127.0.0.1:{sock.getsockname()[1]}")
        yield addresses


@pytest.fixture
def closed_ports() -> Callable[[int], AbstractContextManager[list[str]]]:
    """``with closed_ports(n) as addresses``: n addresses on 127.0.0.1 that refuse connections (bound,
    never listening) while held."""
    return _closed_ports
