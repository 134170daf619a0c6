"""Blob read benchmark: what checking a blob against its sha256 costs a read.

Run from the repository root::

    .venv/bin/python -m bench.blob_read_bench [--quick] [--mib 100] [--repeats 3] [--pg-url URL]
        [--json out.json]

A blob of ``--mib`` MiB of random bytes is stored once per backend: a file next to a SQLite database
(the coordinator's default), 1 MiB chunk rows in SQLite, and chunk rows in PostgreSQL when ``--pg-url``
is given (a server's maintenance database: the bench makes a database of its own there, and drops
it). Each is then read whole, four ways, each timed ``--repeats`` times (medians printed):

* ``raw read`` and ``raw stream``: the backend's chunks, joined or not, with no check (what a read
  cost before blobs were checked);
* ``read, first``: ``SqlBlobStore.read`` on a store that has not read the blob yet: the bytes are read
  once and hashed (one pass);
* ``stream, first``: ``iter_chunks`` on such a store: the blob is hashed whole first (a pass), then
  streamed (a second): no chunk leaves before the whole blob is known good;
* ``read, again`` and ``stream, again``: the same store once more: the blob is known good, not hashed.

Each is given as wall time and as the CPU time of every thread of the process (the machine is shared:
CPU time is the steadier measure of what the check costs). Beside them, ``sha256`` is hashlib alone over
the same bytes in memory. A fresh store (a new process's,
as far as the check is concerned) is opened for each "first" repeat; the bytes are in the page cache
(or the database's buffers) throughout, so the figures are the check's CPU, not a disk's.

``--quick`` (what the test suite runs): 4 MiB, one repeat, SQLite only.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fedlink.server.store import CHUNK_SIZE, SqlStateStore, create_store
from fedlink.server.store.testing import create_pg_database, drop_pg_database

MIB = 1024 * 1024


async def _drain(chunks: AsyncIterator[bytes]) -> int:
    return sum([len(chunk) async for chunk in chunks])


async def _timed(repeats: int, run: Callable[[], Awaitable[int]], expected: int) -> tuple[float, float]:
    """The median wall time and CPU time (every thread of the process: the store's and hashlib's)."""
    walls, cpus = [], []
    for _ in range(repeats):
        started, cpu = time.perf_counter(), time.process_time()
        got = await run()
        walls.append(time.perf_counter() - started)
        cpus.append(time.process_time() - cpu)
        if got != expected:
            raise SystemExit(f"read {got} bytes, not {expected}")
    return statistics.median(walls), statistics.median(cpus)


async def _backend(
    name: str, opener: Callable[[], Awaitable[SqlStateStore]], data: bytes, repeats: int
) -> dict[str, dict[str, float]]:
    size = len(data)
    store = await opener()
    try:
        sha = (await store.blobs.put_bytes(data)).sha256
    finally:
        await store.close()

    async def fresh(read: Callable[[SqlStateStore], Awaitable[int]]) -> tuple[float, float]:
        """The median times of ``read`` on a store that has not read the blob (opened, untimed, each time)."""
        times = []
        for _ in range(repeats):
            opened = await opener()
            try:
                times.append(await _timed(1, functools.partial(read, opened), size))
            finally:
                await opened.close()
        return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)

    async def whole(s: SqlStateStore) -> int:
        return len(await s.blobs.read(sha))

    async def stream(s: SqlStateStore) -> int:
        return await _drain(s.blobs.iter_chunks(sha))

    async def raw_stream(s: SqlStateStore) -> int:
        return await _drain(s.blobs._bytes.read(sha, 0, CHUNK_SIZE))  # the unchecked path

    async def raw_read(s: SqlStateStore) -> int:
        return len(b"".join([chunk async for chunk in s.blobs._bytes.read(sha, 0, CHUNK_SIZE)]))

    figures = {
        "raw read": await fresh(raw_read),
        "read, first": await fresh(whole),
        "raw stream": await fresh(raw_stream),
        "stream, first": await fresh(stream),
    }
    store = await opener()
    try:
        await whole(store)
        figures["read, again"] = await _timed(repeats, lambda: whole(store), size)
        figures["stream, again"] = await _timed(repeats, lambda: stream(store), size)
    finally:
        await store.close()
    print(f"{name}:  wall, CPU (every thread), extra CPU over the unchecked read")
    for what, (wall, cpu) in figures.items():
        base = figures["raw read" if "read" in what else "raw stream"][1]
        extra = f"  {cpu - base:+.3f} s CPU" if not what.startswith("raw") else ""
        print(f"  {what:<14} {wall:7.3f} s {size / MIB / wall:6.0f} MiB/s  {cpu:7.3f} s CPU{extra}")
    return {what: {"wall_s": wall, "cpu_s": cpu} for what, (wall, cpu) in figures.items()}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    mib = 4 if args.quick else args.mib
    repeats = 1 if args.quick else args.repeats
    data = os.urandom(mib * MIB)
    started = time.perf_counter()
    for _ in range(repeats):
        hashlib.sha256(data).hexdigest()
    hashing = (time.perf_counter() - started) / repeats
    print(f"blob of {mib} MiB, {repeats} repeat(s); medians")
    print(f"sha256 in memory {hashing:8.3f} s  {mib / hashing:8.0f} MiB/s")
    report: dict[str, Any] = {"mib": mib, "repeats": repeats, "sha256_s": hashing, "backends": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        openers: dict[str, Callable[[], Awaitable[SqlStateStore]]] = {
            "SQLite + files": lambda: create_store(f"sqlite+aiosqlite:///{root / 'a.db'}"),
            "SQLite chunk rows": lambda: create_store(
                f"sqlite+aiosqlite:///{root / 'b.db'}", blobs_in_database=True
            ),
        }
        if args.pg_url and not args.quick:
            openers["PostgreSQL chunk rows"] = lambda: create_store(args.pg_url, auto_migrate=True)
        for name, opener in openers.items():
            report["backends"][name] = await _backend(name, opener, data, repeats)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 MiB, one repeat, SQLite only")
    parser.add_argument("--mib", type=int, default=100, help="the blob's size in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pg-url", default="", help="a PostgreSQL server's maintenance database URL")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    admin_url = args.pg_url
    if admin_url and not args.quick:
        args.pg_url = create_pg_database(admin_url, prefix="fedlink_bench")
    try:
        report = asyncio.run(run(args))
    finally:
        if admin_url and not args.quick:
            drop_pg_database(admin_url, args.pg_url)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
