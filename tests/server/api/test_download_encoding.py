"""DownloadBlob's hand-encoded responses are the bytes protobuf would serialize, and parse back."""

from __future__ import annotations

import pytest

from fedlink.server.api.runner_servicer import Serialized, encode_download_chunk
from fedlink.v1 import runner_service_pb2 as pb


@pytest.mark.parametrize(
    ("offset", "data", "size"),
    [
        (0, b"", 0),
        (0, b"abc", 3),
        (127, b"x" * 128, 128),
        (128, b"\x00" * 300, 2**40),
        (2**63 - 1, b"\xff", 2**63 - 1),
        (1024 * 1024, bytes(range(256)) * 4096, 3 * 1024**3),
    ],
)
def test_the_encoding_is_protobufs(offset: int, data: bytes, size: int) -> None:
    expected = pb.DownloadBlobResponse(offset=offset, data=data, size_bytes=size)
    encoded = encode_download_chunk(offset, data, size)
    assert encoded == expected.SerializeToString()
    assert pb.DownloadBlobResponse.FromString(encoded) == expected
    assert Serialized(encoded).SerializeToString() is encoded
