"""Fixtures shared by the whole suite: where the checkout and the test interpreter's scripts are."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The root of the checkout under test."""
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def venv_bin() -> Path:
    """The scripts folder of the interpreter running the tests (its console scripts, buf, ...)."""
    # Not resolved: the venv's python is a symlink to the base interpreter, whose folder is not the venv's.
    return Path(sys.executable).parent
