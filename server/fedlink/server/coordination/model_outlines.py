"""What a stored model is (its kind and each variable's dtype and shape), learnt without loading it.

A job's initial model and every round's global model are blobs of many MiB to GiB. Submission checks
the initial model, and result validation needs each task's model spec; neither needs the tensor values.
:class:`ModelOutlines` streams a blob through :func:`~fedlink.common.dxo_outline.read_outline` (a few KiB
in memory whatever the model's size, tensor data jumped over) and keeps the outline per sha256: a blob's
content never changes, and an outline is a few bytes per variable.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fedlink.common.dxo_outline import DxoOutline, read_outline
from fedlink.server.coordination.shared_reads import SharedReads
from fedlink.server.domain.updates import VariableSpec
from fedlink.server.store import BlobStore

#: Outlines kept: the models of the live jobs' current and last rounds.
DEFAULT_CACHE_SIZE = 64


class ModelOutlines:
    """Outlines of DXO blobs by sha256, read by streaming once and then kept (least recently used out)."""

    def __init__(self, blobs: BlobStore, *, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._blobs = blobs
        # The devices of a round report together: the first one's read is shared.
        self._outlines = SharedReads(self._read, cache_size)

    async def outline(self, sha256: str) -> DxoOutline:
        """The outline of the DXO stored as blob ``sha256``.

        Raises:
            NotFound: No such blob.
            InvalidArgument: The blob is not a DXO that :meth:`DXO.from_bytes` would decode.
        """
        return await self._outlines.get(sha256)

    async def spec(self, sha256: str) -> dict[str, VariableSpec]:
        """Each variable's shape and dtype, as the decoded model's arrays would have them."""
        return spec_of(await self.outline(sha256))

    async def _read(self, sha256: str) -> DxoOutline:
        return await read_blob_outline(self._blobs, sha256)


async def read_blob_outline(blobs: BlobStore, sha256: str) -> DxoOutline:
    """The outline of the DXO stored as blob ``sha256``, streamed in the caller's task (not kept)."""
    blob = await blobs.stat(sha256)

    def open_at(offset: int) -> AsyncIterator[bytes]:
        return blobs.iter_chunks(sha256, offset)

    return await read_outline(open_at, blob.size_bytes)


def spec_of(outline: DxoOutline) -> dict[str, VariableSpec]:
    """Each variable's shape and dtype, as the decoded model's arrays would have them."""
    return {
        name: VariableSpec(tensor.shape, tensor.decoded_dtype) for name, tensor in outline.tensors.items()
    }
