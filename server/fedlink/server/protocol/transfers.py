"""Chunked, resumable, sha256-checked blob uploads and downloads, shared by both services."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

from fedlink.common.errors import InvalidArgument, ResourceExhausted
from fedlink.server.store import CHUNK_SIZE, BlobRef, BlobStore, UploadQuota

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
#: Largest chunk one stream message may carry.
MAX_CHUNK_BYTES = 4 * 1024 * 1024


def check_sha256(value: str) -> str:
    """Returns ``value`` if it is a lower-case hex SHA-256; InvalidArgument otherwise."""
    if not _SHA256.match(value):
        raise InvalidArgument(f"{value!r} is not a lower-case hex SHA-256")
    return value


async def receive_upload(
    blobs: BlobStore,
    *,
    sha256: str,
    size_bytes: int,
    offset: int,
    chunks: AsyncIterator[bytes],
    max_bytes: int,
    owner: str | None = None,
    held: Callable[[str], Awaitable[bool]] | None = None,
    quota: UploadQuota | None = None,
) -> BlobRef:
    """Stores the chunks of an upload from ``offset``; commits (sha256-checked) once all bytes are in.

    The upload can be resumed: a dropped stream keeps what arrived, and ``received`` tells the next
    stream where to start. A stream that starts at another offset than the bytes received gets
    FAILED_PRECONDITION from the store, with the offset to resume from.

    ``held`` tells whether the uploader holds the blob already (nothing to upload); by default,
    whether it is stored (it then counts as stored now: not collected before it is used). An
    ``owner``'s upload is its own, within its ``quota`` (see :meth:`BlobStore.begin_upload`).
    """
    check_sha256(sha256)
    if size_bytes < 0:
        raise InvalidArgument("size_bytes must not be negative")
    if size_bytes > max_bytes:
        raise ResourceExhausted(f"the blob is {size_bytes} bytes, over the limit of {max_bytes}")
    if await (blobs.touch if held is None else held)(sha256):
        async for _ in chunks:  # already stored: nothing to keep, but drain what the client sends
            pass
        return BlobRef(sha256=sha256, size_bytes=size_bytes)
    received = await blobs.begin_upload(sha256, size_bytes, owner=owner, quota=quota)
    if offset != received:
        raise InvalidArgument(f"the upload must resume at offset {received}, not {offset}")
    async for chunk in chunks:
        if len(chunk) > MAX_CHUNK_BYTES:
            raise InvalidArgument(f"a chunk may hold at most {MAX_CHUNK_BYTES} bytes")
        if received + len(chunk) > size_bytes:
            raise InvalidArgument(f"the upload sends more than the {size_bytes} bytes it announced")
        received = await blobs.append_upload(sha256, received, chunk, owner=owner)
    if received < size_bytes:
        raise InvalidArgument(
            f"the stream ended after {received} of {size_bytes} bytes: resume from offset {received}"
        )
    return await blobs.commit_upload(sha256, owner=owner)


async def send_blob(
    blobs: BlobStore, sha256: str, *, offset: int = 0, max_chunk_bytes: int = 0
) -> AsyncIterator[tuple[int, bytes, int]]:
    """Yields ``(offset, chunk, size_bytes)`` for a stored blob from ``offset``."""
    check_sha256(sha256)
    blob = await blobs.stat(sha256)
    if offset < 0 or offset > blob.size_bytes:
        raise InvalidArgument(f"offset {offset} is outside the blob's {blob.size_bytes} bytes")
    chunk_size = min(max_chunk_bytes or CHUNK_SIZE, MAX_CHUNK_BYTES)
    if chunk_size < 1:
        raise InvalidArgument("max_chunk_bytes must be positive")
    position = offset
    async with aclosing(blobs.iter_chunks(sha256, offset, chunk_size)) as chunks:  # its file, at once
        async for chunk in chunks:
            yield position, chunk, blob.size_bytes
            position += len(chunk)
