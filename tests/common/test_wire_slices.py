"""A message parsed a slice of top-level fields at a time is the message parsed whole, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from fedlink.common.dxo import parse_dxo
from fedlink.common.errors import InvalidArgument
from fedlink.common.wire_slices import field_cuts, merge_in_slices
from fedlink.v1 import dxo_pb2


def many_tensors(count: int) -> dxo_pb2.Dxo:
    dxo = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    for i in range(count):
        tensor = dxo.data[f"v{i}"]
        tensor.dtype = "float32"
        tensor.shape.append(1)
        tensor.dense.data = np.float32(i).tobytes()
    dxo.meta["num_examples"].int_value = 3
    dxo.items["inner"].kind = dxo_pb2.DATA_KIND_METRICS
    return dxo


@pytest.mark.parametrize("every", [1, 7, 100, 4096, 1 << 30])
def test_slices_merge_to_the_message_parsed_whole(every: int) -> None:
    data = many_tensors(500).SerializeToString()
    cuts = field_cuts(data, every)
    assert cuts is not None and cuts[0] == 0 and cuts[-1] == len(data)
    assert cuts == sorted(set(cuts))
    sliced = dxo_pb2.Dxo()
    merge_in_slices(sliced, data, every)
    assert sliced == dxo_pb2.Dxo.FromString(data)
    assert sliced.SerializeToString(deterministic=True) == many_tensors(500).SerializeToString(
        deterministic=True
    )


def test_repeated_fields_merge_as_the_runtime_merges_them() -> None:
    first = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHTS)
    first.data["w"].dtype = "float32"
    first.meta["k"].int_value = 1
    second = dxo_pb2.Dxo(kind=dxo_pb2.DATA_KIND_WEIGHT_DIFF)
    second.data["w"].dtype = "float64"  # a repeated key replaces the entry
    second.meta["k"].string_value = "two"
    data = first.SerializeToString() + second.SerializeToString()
    sliced = dxo_pb2.Dxo()
    merge_in_slices(sliced, data, 1)
    assert sliced == dxo_pb2.Dxo.FromString(data)
    assert sliced.kind == dxo_pb2.DATA_KIND_WEIGHT_DIFF and sliced.data["w"].dtype == "float64"


@pytest.mark.parametrize(
    "data",
    [
        b"\x12\x05ab",  # a length running past the end
        b"\x08" + b"\xff" * 11,  # an overlong varint
        b"\x12",  # a tag without its length
    ],
)
def test_bytes_the_scan_does_not_follow_are_parsed_whole_and_refused_as_whole(data: bytes) -> None:
    assert field_cuts(data, 1) is None
    with pytest.raises(DecodeError):
        merge_in_slices(dxo_pb2.Dxo(), data, 1)
    with pytest.raises(InvalidArgument, match=r"not a valid fedlink\.v1\.Dxo"):
        parse_dxo(data, slice_bytes=1)


def test_a_group_is_not_scanned_and_the_message_is_parsed_whole() -> None:
    data = b"\x0b\x0c" + many_tensors(3).SerializeToString()  # an empty group, field 1: unknown
    assert field_cuts(data, 1) is None
    sliced = dxo_pb2.Dxo()
    merge_in_slices(sliced, data, 1)
    assert sliced == dxo_pb2.Dxo.FromString(data)


def test_parse_dxo_in_slices_gives_the_same_message() -> None:
    data = many_tensors(2000).SerializeToString()
    assert parse_dxo(data, slice_bytes=1024) == parse_dxo(data)
