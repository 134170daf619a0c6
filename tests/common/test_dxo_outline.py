"""Tests for fedlink.common.dxo_outline: a DXO's outline read from chunks agrees with DXO.from_bytes."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from fedlink.common.dxo import DXO, DataKind
from fedlink.common.dxo_outline import DxoOutline, TensorOutline, read_outline
from fedlink.common.errors import InvalidArgument
from fedlink.common.tensors import TensorEncoding
from fedlink.v1 import dxo_pb2


class ChunkSource:
    """Serves ``data`` from any offset in chunks of ``chunk`` bytes and records what it handed out."""

    def __init__(self, data: bytes, chunk: int) -> None:
        self.data = data
        self.chunk = chunk
        self.opened: list[int] = []
        self.bytes_read = 0

    async def __call__(self, offset: int) -> AsyncIterator[bytes]:
        self.opened.append(offset)
        for at in range(offset, len(self.data), self.chunk):
            piece = self.data[at : at + self.chunk]
            self.bytes_read += len(piece)
            yield piece


async def outline(data: bytes, chunk: int = 7, **kwargs: Any) -> DxoOutline:
    return await read_outline(ChunkSource(data, chunk), len(data), **kwargs)


def expected_outline(dxo: DXO) -> dict[str, tuple[str, tuple[int, ...], np.dtype[Any]]]:
    return {name: (str(a.dtype), a.shape, a.dtype) for name, a in dxo.data.items()}


def described(result: DxoOutline) -> dict[str, tuple[str, tuple[int, ...], np.dtype[Any]]]:
    return {name: (str(t.decoded_dtype), t.shape, t.decoded_dtype) for name, t in result.tensors.items()}


def sample_dxo() -> DXO:
    rng = np.random.default_rng(3)
    return DXO(
        kind=DataKind.WEIGHTS,
        data={
            "conv.w": rng.standard_normal((3, 4, 2)).astype(np.float32),
            "bias": np.arange(5, dtype=np.float64),
            "half": rng.standard_normal(6).astype(np.float32),
            "mask": np.array([0, 0, 3, 0, 7, 0, 0, 9], dtype=np.int64),
            "scalar": np.array(2.5, dtype=np.float32),
            "empty": np.zeros((0, 4), dtype=np.int8),
            "bf": np.ones(3, dtype=ml_dtypes.bfloat16),
            "flags": np.array([True, False]),
        },
        meta={"num_examples": 10, "note": "x", "cfg": {"a": [1, 2]}},
        encodings={"half": TensorEncoding.FLOAT16, "mask": TensorEncoding.SPARSE},
    )


@pytest.mark.parametrize("chunk", [1, 3, 64, 1 << 20])
async def test_the_outline_names_what_from_bytes_decodes(chunk: int) -> None:
    dxo = sample_dxo()
    data = dxo.to_bytes()
    result = await outline(data, chunk)
    decoded = DXO.from_bytes(data)
    assert result.kind is DataKind.WEIGHTS
    assert described(result) == expected_outline(decoded)
    assert result.meta == decoded.meta
    assert result.tensors["mask"] == TensorOutline("int64", (8,), TensorEncoding.SPARSE)
    assert result.tensors["half"].encoding is TensorEncoding.FLOAT16


async def test_a_collection_outlines_its_items() -> None:
    inner = DXO(kind=DataKind.WEIGHT_DIFF, data={"w": np.ones((2, 2), np.float32)}, meta={"k": 1})
    dxo = DXO(
        kind=DataKind.COLLECTION, items={"a": inner, "b": DXO(kind=DataKind.METRICS, meta={"acc": 0.5})}
    )
    result = await outline(dxo.to_bytes())
    assert result.kind is DataKind.COLLECTION and not result.tensors
    assert result.items["a"].tensors == {"w": TensorOutline("float32", (2, 2), TensorEncoding.DENSE)}
    assert result.items["a"].meta == {"k": 1}
    assert result.items["b"].meta == {"acc": 0.5}


async def test_large_tensor_data_is_jumped_over_not_read() -> None:
    big = np.zeros(4 << 20, dtype=np.float32)  # 16 MiB
    data = DXO(kind=DataKind.WEIGHTS, data={"a": big, "b": np.ones(3, np.float32)}).to_bytes()
    source = ChunkSource(data, 1 << 20)
    result = await read_outline(source, len(data), seek_bytes=1 << 20)
    assert result.tensors["a"].shape == (4 << 20,)
    assert len(source.opened) >= 2  # reopened past the large field
    assert source.bytes_read < 4 << 20


def wire_variants() -> list[tuple[str, bytes]]:
    """Encodings the protobuf runtime accepts that a deterministic serializer never writes."""
    tensor = dxo_pb2.Tensor(dtype="float32", shape=[2, 3])
    tensor.dense.data = np.arange(6, dtype="<f4").tobytes()
    message = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHTS)
    message.data["w"].CopyFrom(tensor)
    base = message.SerializeToString()

    def entry(name: str, value: bytes) -> bytes:
        key = name.encode()
        body = b"\x0a" + bytes([len(key)]) + key + b"\x12" + varint(len(value)) + value
        return b"\x12" + varint(len(body)) + body

    unpacked = b"\x0a\x07float32" + b"\x10\x02\x10\x03" + b"\x1a" + varint(26) + b"\x0a\x18" + bytes(24)
    split = b"\x0a\x07float32\x12\x01\x02" + b"\x1a\x00" + b"\x12\x01\x03\x1a\x1a\x0a\x18" + bytes(24)
    # The value field given twice merges: the second dense message replaces the data.
    merged = b"\x0a\x07float32\x12\x02\x02\x03\x1a\x02\x0a\x00" + b"\x1a\x1a\x0a\x18" + bytes(24)
    # Another oneof member clears the one before it.
    switched = b"\x0a\x07float32\x12\x02\x02\x03\x2a\x02\x0a\x00" + b"\x1a\x1a\x0a\x18" + bytes(24)
    unknown = b"\x78\x05" + b"\x81\x01" + bytes(8) + b"\x8b\x01\x08\x01\x8c\x01"  # varint, fixed64, group
    wrong_type = b"\x0d\x01\x00\x00\x00"  # field 1 (kind) as fixed32: an unknown field
    return [
        ("base", base),
        ("unpacked shape", b"\x08\x01" + entry("w", unpacked)),
        ("shape in two packed runs", b"\x08\x01" + entry("w", split)),
        ("merged value", b"\x08\x01" + entry("w", merged)),
        ("switched encoding", b"\x08\x01" + entry("w", switched)),
        ("duplicate key, last wins", b"\x08\x01" + entry("w", b"\x0a\x05int32") + entry("w", unpacked)),
        ("unknown fields", unknown + base + unknown),
        ("kind with another wire type", wrong_type + base),
        ("kind twice", b"\x08\x03" + base),
    ]


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | 0x80 if value else low)
        if not value:
            return bytes(out)


@pytest.mark.parametrize(("label", "data"), wire_variants(), ids=[label for label, _ in wire_variants()])
async def test_wire_variants_read_as_the_runtime_reads_them(label: str, data: bytes) -> None:
    decoded = DXO.from_bytes(data)
    result = await outline(data, 5)
    assert result.kind is decoded.kind
    assert described(result) == expected_outline(decoded)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (
            dxo_pb2.Tensor(dtype="float32", shape=[3], dense=dxo_pb2.DenseEncoding(data=bytes(8))),
            "dense data",
        ),
        (dxo_pb2.Tensor(dtype="complex64", shape=[1]), "unknown dtype"),
        (dxo_pb2.Tensor(dtype="float32", shape=[-1]), "negative dimension"),
        (dxo_pb2.Tensor(dtype="float32", shape=[2]), "no encoding"),
        (
            dxo_pb2.Tensor(dtype="int32", shape=[1], float16=dxo_pb2.Float16Encoding(data=bytes(2))),
            "float dtypes",
        ),
        (
            dxo_pb2.Tensor(
                dtype="float32",
                shape=[4],
                sparse=dxo_pb2.SparseEncoding(indices=np.array([2, 1], "<i8").tobytes(), values=bytes(8)),
            ),
            "strictly increasing",
        ),
        (
            dxo_pb2.Tensor(
                dtype="float32",
                shape=[4],
                sparse=dxo_pb2.SparseEncoding(indices=np.array([1, 4], "<i8").tobytes(), values=bytes(8)),
            ),
            "out of range",
        ),
        (
            dxo_pb2.Tensor(dtype="float32", shape=[4], sparse=dxo_pb2.SparseEncoding(indices=bytes(9))),
            "multiple of 8",
        ),
    ],
)
async def test_a_malformed_tensor_is_refused_as_from_bytes_refuses_it(
    tensor: dxo_pb2.Tensor, message: str
) -> None:
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHTS)
    dxo.data["w"].CopyFrom(tensor)
    data = dxo.SerializeToString()
    with pytest.raises(InvalidArgument, match=message):
        DXO.from_bytes(data)
    with pytest.raises(InvalidArgument, match=message):
        await outline(data, 3)


async def test_too_many_elements_are_refused_before_anything_is_read() -> None:
    data = DXO(kind=DataKind.WEIGHTS, data={"w": np.zeros(100, np.float32)}).to_bytes()
    with pytest.raises(InvalidArgument, match="more than the limit of 10"):
        await outline(data, max_elements=10)


@pytest.mark.parametrize("cut", [1, 5, 40, -1])
async def test_truncated_bytes_are_refused(cut: int) -> None:
    data = sample_dxo().to_bytes()
    short = data[:cut]
    with pytest.raises(InvalidArgument):
        DXO.from_bytes(short)
    with pytest.raises(InvalidArgument, match=r"not a valid fedlink\.v1\.Dxo"):
        await outline(short)


async def test_a_source_shorter_than_its_size_is_truncated() -> None:
    data = sample_dxo().to_bytes()
    with pytest.raises(InvalidArgument, match="truncated"):
        await read_outline(ChunkSource(data[:-5], 64), len(data))


async def test_corrupted_bytes_are_refused_exactly_when_from_bytes_refuses_them() -> None:
    """Seeded byte flips, insertions and cuts of real DXOs: the outline and the full parse agree."""
    rng = random.Random(20240607)
    collection = DXO(kind=DataKind.COLLECTION, items={"a": sample_dxo(), "m": DXO(kind=DataKind.METRICS)})
    originals = [sample_dxo().to_bytes(), collection.to_bytes()] + [data for _, data in wire_variants()]
    for trial in range(3000):
        data = bytearray(rng.choice(originals))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(data))
            action = rng.random()
            if action < 0.6:
                data[at] = rng.randrange(256)
            elif action < 0.8:
                data.insert(at, rng.randrange(256))
            else:
                del data[at]
        blob = bytes(data)
        try:
            decoded = DXO.from_bytes(blob)
        except InvalidArgument:
            decoded = None
        try:
            result = await outline(blob, rng.choice([1, 2, 5, 64]))
        except InvalidArgument:
            result = None
        assert (decoded is None) == (result is None), f"trial {trial}: {blob.hex()}"
        if decoded is not None and result is not None:
            assert result.kind is decoded.kind, f"trial {trial}"
            assert described(result) == expected_outline(decoded), f"trial {trial}: {blob.hex()}"
            assert result.meta.keys() == decoded.meta.keys(), f"trial {trial}"
