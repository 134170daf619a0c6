"""DirectoryBytes.read: a blob file read in chunks, several chunks per worker-thread hop."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fedlink.server.store.blob_backends import _READ_AHEAD_BYTES, DirectoryBytes

MiB = 1024 * 1024


@pytest.mark.parametrize(
    ("size", "offset", "chunk"),
    [
        (0, 0, MiB),
        (10, 0, 3),
        (_READ_AHEAD_BYTES, 0, MiB),  # exactly one hop's worth
        (2 * _READ_AHEAD_BYTES, 5, MiB),
        (_READ_AHEAD_BYTES + 1, 0, MiB),
        (3 * MiB + 7, MiB + 3, 1000),
        (MiB, 0, 8 * MiB),  # chunks larger than a hop
        (MiB, MiB, 64),  # from the end: nothing
    ],
)
async def test_reads_every_byte_from_the_offset_in_bounded_chunks(
    tmp_path: Path, size: int, offset: int, chunk: int
) -> None:
    backend = DirectoryBytes(tmp_path)
    data = os.urandom(size)
    backend._write_sync("up-test", 0, data)
    chunks = [c async for c in backend.read("up-test", offset, chunk)]
    assert b"".join(chunks) == data[offset:]
    assert all(0 < len(c) <= chunk for c in chunks)
    assert all(len(c) == chunk for c in chunks[:-1])


async def test_a_read_abandoned_early_closes_its_file(tmp_path: Path) -> None:
    backend = DirectoryBytes(tmp_path)
    backend._write_sync("up-test", 0, os.urandom(3 * MiB))
    before = len(os.listdir("/proc/self/fd"))
    reader = backend.read("up-test", 0, MiB)
    assert len(await anext(reader)) == MiB
    assert len(os.listdir("/proc/self/fd")) == before + 1
    await reader.aclose()
    assert len(os.listdir("/proc/self/fd")) == before


async def test_a_missing_blob_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        await anext(DirectoryBytes(tmp_path).read("up-missing", 0, MiB))
