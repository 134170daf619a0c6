"""Limits on a DXO's structure and on JSON depth and size, checked before anything is decoded; a wire
DXO seen by what it declares (DeclaredDxo); the same limits when a DXO is only outlined."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

from fedlink.common.dxo import (
    DXO,
    MAX_ITEMS,
    MAX_META_BYTES,
    MAX_META_ENTRIES,
    MAX_TENSORS,
    DataKind,
    parse_dxo,
)
from fedlink.common.dxo_outline import DeclaredDxo, TensorOutline, read_outline
from fedlink.common.errors import InvalidArgument
from fedlink.common.json_limits import MAX_JSON_DEPTH, json_depth, load_json
from fedlink.common.tensors import TensorEncoding
from fedlink.v1 import dxo_pb2


def with_tensors(count: int) -> bytes:
    message = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHTS)
    for i in range(count):
        tensor = message.data[f"v{i}"]
        tensor.dtype = "float32"
        tensor.dense.data = b"\0\0\0\0"
    return message.SerializeToString()


def with_items(count: int) -> bytes:
    message = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_COLLECTION)
    for i in range(count):
        message.items[f"i{i}"].kind = dxo_pb2.DATA_KIND_METRICS
    return message.SerializeToString()


def with_meta(**values: dxo_pb2.MetaValue) -> bytes:
    message = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_METRICS)
    for key, value in values.items():
        message.meta[key].CopyFrom(value)
    return message.SerializeToString()


def with_entries(count: int) -> bytes:
    return with_meta(**{f"m{i}": dxo_pb2.MetaValue(int_value=i) for i in range(count)})


def text(size: int) -> dxo_pb2.MetaValue:
    return dxo_pb2.MetaValue(string_value="x" * size)


async def outline_of(data: bytes) -> object:
    async def chunks(offset: int) -> AsyncIterator[bytes]:
        for at in range(offset, len(data), 4096):
            yield data[at : at + 4096]

    return await read_outline(chunks, len(data))


# Each limit: a DXO just within it, one just over it, and what the refusal says.
LIMITS = [
    ("tensors", with_tensors(MAX_TENSORS), with_tensors(MAX_TENSORS + 1), f"limit of {MAX_TENSORS} tensors"),
    ("items", with_items(MAX_ITEMS), with_items(MAX_ITEMS + 1), f"limit of {MAX_ITEMS} items"),
    (
        "meta entries",
        with_entries(MAX_META_ENTRIES),
        with_entries(MAX_META_ENTRIES + 1),
        f"limit of {MAX_META_ENTRIES} meta entries",
    ),
    (
        # The key "s" is 1 byte, the value's serialized size 1 tag byte, 3 length bytes and the text.
        "meta bytes",
        with_meta(s=text(MAX_META_BYTES - 5)),
        with_meta(s=text(MAX_META_BYTES - 4)),
        f"limit of {MAX_META_BYTES} bytes of meta",
    ),
]


@pytest.mark.parametrize(("within", "over", "says"), [c[1:] for c in LIMITS], ids=[c[0] for c in LIMITS])
async def test_a_dxo_over_a_limit_is_refused_by_every_reader(within: bytes, over: bytes, says: str) -> None:
    DXO.from_bytes(within)
    DeclaredDxo.parse(within)
    await outline_of(within)
    with pytest.raises(InvalidArgument, match=says):
        DXO.from_bytes(over)
    with pytest.raises(InvalidArgument, match=says):
        DeclaredDxo.parse(over)
    with pytest.raises(InvalidArgument, match=says):
        await outline_of(over)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    ("document", "depth"),
    [
        ("1", 0),
        ('"[[[["', 0),
        ("[]", 1),
        ('{"a": [1, {"b": [2]}]}', 4),
        (r'["\"[[[", "\\", [[]]]', 3),  # escaped quotes and backslashes end no string early
        (nested(500), 500),
    ],
)
def test_json_depth_counts_brackets_outside_strings(document: str, depth: int) -> None:
    assert json_depth(document) == depth


async def test_json_in_meta_is_bounded_in_depth_not_in_its_brackets() -> None:
    deep = with_meta(cfg=dxo_pb2.MetaValue(json_value=nested(MAX_JSON_DEPTH + 1)))
    says = r"meta 'cfg': json_value nests .* 65 deep.* limit of 64"
    with pytest.raises(InvalidArgument, match=says):
        DXO.from_bytes(deep)
    with pytest.raises(InvalidArgument, match=says):
        await outline_of(deep)
    # 10,000 deep raised RecursionError inside json.loads.
    with pytest.raises(InvalidArgument, match="10000 deep"):
        DXO.from_bytes(with_meta(cfg=dxo_pb2.MetaValue(json_value=nested(10_000))))
    fine = '{"label": "' + "[" * 1000 + '", "v": ' + nested(MAX_JSON_DEPTH - 1) + "}"
    cfg = DXO.from_bytes(with_meta(cfg=dxo_pb2.MetaValue(json_value=fine))).meta["cfg"]
    assert isinstance(cfg, dict) and cfg["label"] == "[" * 1000


def test_load_json_names_the_limit_it_enforces() -> None:
    with pytest.raises(InvalidArgument, match=r"^job_data is 12 bytes, more than the limit of 10 bytes$"):
        load_json('{"a": "bcd"}', what="job_data", max_bytes=10)
    with pytest.raises(
        InvalidArgument, match=r"^doc nests arrays and objects 3 deep, more than the limit of 2$"
    ):
        load_json("[[[]]]", what="doc", max_depth=2)
    with pytest.raises(InvalidArgument, match=r"^doc is not valid JSON"):
        load_json("[NaN]", what="doc")
    assert load_json("[NaN]", what="doc", strict=False)[0] != 0  # NaN, as Python's json reads it
    assert load_json('{"é": [1]}', what="doc", max_bytes=11) == {"é": [1]}  # 11 bytes in UTF-8


def test_a_declared_dxo_outlines_tensors_on_lookup_and_decodes_what_it_declares() -> None:
    dxo = DXO(
        kind=DataKind.WEIGHT_DIFF,
        data={"w": np.ones((2, 3), np.float32), "m": np.array([0, 0, 5], np.int64)},
        meta={"num_examples": 4},
        encodings={"m": TensorEncoding.SPARSE},
    )
    declared = DeclaredDxo.parse(dxo.to_bytes())
    assert declared.kind is DataKind.WEIGHT_DIFF
    assert sorted(declared.tensors) == ["m", "w"] and len(declared.tensors) == 2
    assert declared.tensors["m"] == TensorOutline("int64", (3,), TensorEncoding.SPARSE)
    assert "z" not in declared.tensors and len(declared.tensors) == 2  # a miss adds no entry
    assert declared.decoded_nbytes() == 6 * 4 + 3 * 8
    decoded = declared.decode()
    assert decoded.meta == {"num_examples": 4}
    np.testing.assert_array_equal(decoded.data["m"], [0, 0, 5])


def test_a_declared_dxo_refuses_its_structure_at_once_and_a_tensor_when_it_is_looked_up() -> None:
    message = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHTS)
    message.data["ok"].CopyFrom(dxo_pb2.Tensor(dtype="float32", shape=[1], dense=dxo_pb2.DenseEncoding()))
    message.data["bad"].CopyFrom(dxo_pb2.Tensor(dtype="float31", shape=[1]))
    message.data["huge"].CopyFrom(
        dxo_pb2.Tensor(dtype="float32", shape=[2**40], sparse=dxo_pb2.SparseEncoding())
    )
    declared = DeclaredDxo(message)  # the tensors are not read yet
    assert declared.tensors["ok"].shape == (1,)
    with pytest.raises(InvalidArgument, match="tensor 'bad'"):
        declared.tensors["bad"]
    with pytest.raises(InvalidArgument, match=r"tensor 'huge'.*more than the limit"):
        declared.tensors["huge"]
    message.items["x"].kind = dxo_pb2.DATA_KIND_METRICS
    with pytest.raises(InvalidArgument, match="items are only for COLLECTION"):
        DeclaredDxo(message)
    with pytest.raises(InvalidArgument, match="kind"):
        DeclaredDxo(dxo_pb2.Dxo())
    with pytest.raises(InvalidArgument, match=r"not a valid fedlink\.v1\.Dxo"):
        DeclaredDxo.parse(b"\xff\xff\xff")
    assert parse_dxo(b"").kind == dxo_pb2.DATA_KIND_UNSPECIFIED
