"""File-system durability helpers shared by the runner's state directory and the coordinator's blobs."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_directory"]


def fsync_directory(directory: Path) -> None:
    """Makes the directory's entries (a file created or renamed into it) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
