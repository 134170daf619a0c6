"""Proof of possession for the device protocol: a device's blobs are those it uploaded or was handed.

Blobs are content-addressed and stored once. Knowing a sha256 is not enough to use one: a device
holds a blob once it uploaded the whole bytes itself (sha256-checked; if the content is stored
already, the stored bytes are kept and the upload dropped), or when the blob is the input of a task
it was handed (what DownloadBlob lets it read). So a device can neither learn whether another
device's blob exists (GetBlobUploadStatus, UploadBlob) nor report it as its own (ReportResult).
The ControlService (operators) is not subject to this: it sees every blob.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fedlink.common.errors import PermissionDenied, Unavailable
from fedlink.server.protocol.transfers import check_sha256, receive_upload
from fedlink.server.store import BlobRef, StateStore, UploadQuota


async def upload_status(store: StateStore, device_id: str, sha256: str) -> tuple[int, bool]:
    """How many bytes of the device's own upload arrived, and whether it holds the blob whole.

    A stored blob the device does not hold reads as nothing received: it uploads the bytes.
    """
    check_sha256(sha256)
    if await store.device_holds_blob(device_id, sha256):
        return (await store.blobs.stat(sha256)).size_bytes, True
    return await store.blobs.received_bytes(sha256, owner=device_id), False


async def receive_device_upload(
    store: StateStore,
    device_id: str,
    *,
    sha256: str,
    size_bytes: int,
    offset: int,
    chunks: AsyncIterator[bytes],
    max_bytes: int,
    quota: UploadQuota | None = None,
) -> BlobRef:
    """Stores a device's upload (its own, resumable, sha256-checked, within its ``quota``) and grants
    it the blob."""
    held_before = False

    async def held(sha: str) -> bool:
        nonlocal held_before
        # A blob the device holds counts as stored now: it is about to report it.
        held_before = await store.device_holds_blob(device_id, sha) and await store.blobs.touch(sha)
        return held_before

    ref = await receive_upload(
        store.blobs,
        sha256=sha256,
        size_bytes=size_bytes,
        offset=offset,
        chunks=chunks,
        max_bytes=max_bytes,
        owner=device_id,
        held=held,
        quota=quota,
    )
    if not held_before and not await store.grant_blob(ref.sha256, device_id):
        raise Unavailable(f"blob {ref.sha256} was collected as its upload ended: upload it again")
    return ref


async def put_device_bytes(store: StateStore, device_id: str, data: bytes) -> BlobRef:
    """Stores bytes a device handed over whole (in-process) and grants it the blob."""
    ref = await store.blobs.put_bytes(data)
    if not await store.grant_blob(ref.sha256, device_id):
        raise Unavailable(f"blob {ref.sha256} was collected as it was stored: store it again")
    return ref


async def require_held(store: StateStore, device_id: str, sha256: str) -> None:
    """Refuses a blob the device does not hold, the same way whether or not it is stored.

    Raises:
        InvalidArgument: ``sha256`` is not a lower-case hex SHA-256.
        PermissionDenied: the device neither uploaded the blob whole nor was handed it.
    """
    check_sha256(sha256)
    if not await store.device_holds_blob(device_id, sha256):
        raise PermissionDenied(
            f"result blob {sha256} was not uploaded by this device (or its upload is not complete): "
            "upload it with UploadBlob, then report it"
        )
