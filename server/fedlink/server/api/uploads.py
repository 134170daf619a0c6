"""Upload streams shared by both services: header first, then chunks, into the blob store."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fedlink.common.errors import InvalidArgument
from fedlink.server.protocol.transfers import check_sha256, receive_upload
from fedlink.server.store import BlobRef, BlobStore
from fedlink.v1 import dxo_pb2


async def receive_stream(blobs: BlobStore, requests: AsyncIterator[Any], *, max_bytes: int) -> BlobRef:
    """Stores an UploadBlob or UploadModel stream (resumable, sha256-checked); returns the blob."""
    header, chunks = await split_upload(requests)
    return await receive_upload(
        blobs,
        sha256=header.sha256,
        size_bytes=header.size_bytes,
        offset=header.offset,
        chunks=chunks,
        max_bytes=max_bytes,
    )


async def split_upload(
    requests: AsyncIterator[Any],
) -> tuple[dxo_pb2.BlobUploadHeader, AsyncIterator[bytes]]:
    """Takes an upload stream's header off and returns it with an iterator over the chunks.

    Serves both UploadBlobRequest and UploadModelRequest: each is a ``part`` oneof of a header and
    a chunk.
    """
    iterator = aiter(requests)
    try:
        first = await anext(iterator)
    except StopAsyncIteration:
        raise InvalidArgument("the upload stream is empty: send the header first") from None
    if first.WhichOneof("part") != "header":
        raise InvalidArgument("the first message of an upload must be the header")
    header: dxo_pb2.BlobUploadHeader = first.header

    async def chunks() -> AsyncIterator[bytes]:
        async for message in iterator:
            if message.WhichOneof("part") != "chunk":
                raise InvalidArgument("only the first message of an upload may be a header")
            yield message.chunk

    return header, chunks()


async def upload_status(blobs: BlobStore, sha256: str) -> tuple[int, bool]:
    """How many bytes of an upload arrived, and whether the blob is complete."""
    check_sha256(sha256)
    if await blobs.exists(sha256):
        return (await blobs.stat(sha256)).size_bytes, True
    return await blobs.received_bytes(sha256), False
