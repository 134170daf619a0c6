"""Tests for the DXO in fedlink.common.dxo: wire and dict forms, validation, metadata, weights."""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest

from fedlink.common.dxo import DXO, DataKind, MetaKey, weight_of
from fedlink.common.errors import InvalidArgument
from fedlink.common.tensors import TensorEncoding, encode_tensor
from fedlink.v1 import dxo_pb2

META: dict[str, Any] = {
    MetaKey.NUM_EXAMPLES: 1200,
    "loss": 0.25,
    "name": "site-1",
    "converged": False,
    "blob": b"\x00\xffraw",
    "per_class": [0.5, 0.75, 1],
    "config": {"lr": 0.01, "layers": [64, 32], "nested": {"ok": True, "none": None}},
    "big": 2**63 - 1,
    "small": -(2**63),
    "nan_loss": math.nan,
}


def assert_same_data(actual: dict[str, npt.NDArray[Any]], expected: dict[str, npt.NDArray[Any]]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, array in expected.items():
        assert actual[name].dtype == array.dtype, name
        assert actual[name].shape == array.shape, name
        assert actual[name].tobytes() == np.ascontiguousarray(array).tobytes(), name


def assert_same_meta(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert type(actual[key]) is type(value), key
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(actual[key])
        else:
            assert actual[key] == value, key


def weights_dxo() -> DXO:
    return DXO(
        kind=DataKind.WEIGHT_DIFF,
        data={
            "layer1.weight": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
            "layer1.bias": np.zeros(4, dtype=np.float64),
            "embed": np.ones((2, 3), dtype=ml_dtypes.bfloat16),
            "step": np.array(7, dtype=np.int64),
            "mask": np.array([True, False, True]),
        },
        meta=dict(META),
        encodings={"layer1.bias": TensorEncoding.SPARSE, "embed": TensorEncoding.FLOAT16},
    )


@pytest.mark.parametrize("via", ["proto", "bytes"])
def test_a_dxo_round_trips_through_the_wire(via: str) -> None:
    dxo = weights_dxo()
    back = DXO.from_proto(dxo.to_proto()) if via == "proto" else DXO.from_bytes(dxo.to_bytes())
    assert back.kind is DataKind.WEIGHT_DIFF
    assert_same_data(back.data, dxo.data)
    assert_same_meta(back.meta, META)
    assert back.items == {}
    # Every variable's encoding comes back from the wire, the unlisted ones as dense.
    assert back.encodings == {
        "layer1.weight": TensorEncoding.DENSE,
        "layer1.bias": TensorEncoding.SPARSE,
        "embed": TensorEncoding.FLOAT16,
        "step": TensorEncoding.DENSE,
        "mask": TensorEncoding.DENSE,
    }


def test_the_wire_message_uses_each_variables_encoding() -> None:
    message = weights_dxo().to_proto()
    assert message.kind == dxo_pb2.DATA_KIND_WEIGHT_DIFF
    assert message.data["layer1.bias"].WhichOneof("encoding") == "sparse"
    assert message.data["layer1.bias"].sparse.indices == b""
    assert message.data["embed"].WhichOneof("encoding") == "float16"
    assert message.data["layer1.weight"].WhichOneof("encoding") == "dense"
    assert message.meta[MetaKey.NUM_EXAMPLES].WhichOneof("kind") == "int_value"
    assert message.meta["converged"].WhichOneof("kind") == "bool_value"
    assert message.meta["per_class"].json_value == "[0.5, 0.75, 1]"


@pytest.mark.parametrize("kind", list(DataKind))
def test_every_kind_maps_to_its_wire_enum_and_back(kind: DataKind) -> None:
    dxo = DXO(kind=kind)
    message = dxo.to_proto()
    assert dxo_pb2.DataKind.Name(message.kind) == f"DATA_KIND_{kind}"
    assert DXO.from_proto(message).kind is kind


def test_a_collection_nests_dxos_in_items() -> None:
    inner = DXO(DataKind.METRICS, meta={"accuracy": 0.9})
    site = DXO(DataKind.COLLECTION, items={"metrics": inner, "model": weights_dxo()}, meta={"site": "a"})
    top = DXO(DataKind.COLLECTION, items={"site-a": site})
    back = DXO.from_bytes(top.to_bytes())
    assert back.kind is DataKind.COLLECTION
    assert back.data == {}
    model = back.items["site-a"].items["model"]
    assert_same_data(model.data, weights_dxo().data)
    assert back.items["site-a"].items["metrics"].meta == {"accuracy": 0.9}
    assert back.items["site-a"].meta == {"site": "a"}


def test_to_bytes_is_deterministic_whatever_the_insertion_order() -> None:
    a = DXO(DataKind.WEIGHTS, data={"a": np.ones(2), "b": np.zeros(3)}, meta={"x": 1, "y": "z"})
    b = DXO(DataKind.WEIGHTS, data={"b": np.zeros(3), "a": np.ones(2)}, meta={"y": "z", "x": 1})
    assert a.to_bytes() == b.to_bytes()
    assert a.to_bytes() != DXO(DataKind.WEIGHT_DIFF, data=dict(a.data), meta=dict(a.meta)).to_bytes()


def test_decoded_dense_data_is_read_only() -> None:
    back = DXO.from_bytes(weights_dxo().to_bytes())
    with pytest.raises(ValueError, match="read-only"):
        back.data["layer1.weight"][0, 0] = 1.0


def test_numpy_scalars_in_meta_travel_as_python_values() -> None:
    # numpy scalars are accepted at run time though MetaValue does not name them.
    meta: dict[str, Any] = {
        "n": np.int64(12),
        "u": np.uint8(3),
        "acc": np.float32(0.5),
        "flag": np.bool_(True),
        "hist": [np.int32(1), np.float64(2.5), np.array([1, 2])],
    }
    dxo = DXO(DataKind.METRICS, meta=meta)
    back = DXO.from_proto(dxo.to_proto())
    assert_same_meta(back.meta, {"n": 12, "u": 3, "acc": 0.5, "flag": True, "hist": [1, 2.5, [1, 2]]})


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (None, "a NoneType has no wire form"),
        (object(), "a object has no wire form"),
        ({1, 2}, "a set has no wire form"),
        (2**63, "integer 9223372036854775808 does not fit in 64 bits"),
        (-(2**63) - 1, "integer -9223372036854775809 does not fit in 64 bits"),
        ([1.0, math.nan], "cannot be sent as JSON: Out of range float values"),
        ({"k": object()}, "cannot be sent as JSON: object is not JSON serializable"),
    ],
)
def test_meta_values_without_a_wire_form_are_refused(value: object, error: str) -> None:
    dxo = DXO(DataKind.METRICS, meta={"bad": value})  # type: ignore[dict-item]
    with pytest.raises(InvalidArgument, match=rf"meta 'bad': {error}"):
        dxo.to_proto()


def _message(kind: int = dxo_pb2.DATA_KIND_WEIGHTS) -> dxo_pb2.Dxo:
    return dxo_pb2.Dxo(kind=kind)  # type: ignore[arg-type]


def test_wire_dxos_with_bad_kinds_meta_or_items_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="unknown or unspecified kind 0"):
        DXO.from_proto(_message(dxo_pb2.DATA_KIND_UNSPECIFIED))
    with pytest.raises(InvalidArgument, match="unknown or unspecified kind 99"):
        DXO.from_proto(_message(99))

    empty_meta = _message()
    empty_meta.meta["weight"].SetInParent()
    with pytest.raises(InvalidArgument, match="meta 'weight': no value set"):
        DXO.from_proto(empty_meta)

    for document, detail in (("{not json", "Expecting property name"), ("[1, NaN]", "NaN is not valid JSON")):
        bad_json = _message()
        bad_json.meta["cfg"].json_value = document
        with pytest.raises(InvalidArgument, match=f"meta 'cfg': json_value is not valid JSON: {detail}"):
            DXO.from_proto(bad_json)

    items_on_weights = _message()
    items_on_weights.items["x"].kind = dxo_pb2.DATA_KIND_METRICS
    with pytest.raises(InvalidArgument, match="items are only for COLLECTION, not WEIGHTS"):
        DXO.from_proto(items_on_weights)


def test_a_bad_tensor_deep_in_a_collection_is_named_by_its_path() -> None:
    message = _message(dxo_pb2.DATA_KIND_COLLECTION)
    site = message.items["site-a"]
    site.kind = dxo_pb2.DATA_KIND_WEIGHTS
    site.data["w"].CopyFrom(encode_tensor(np.ones(4, dtype=np.float32)))
    site.data["w"].dense.data = b"\0" * 3
    with pytest.raises(InvalidArgument, match=r"tensor 'site-a/w': dense data is 3 bytes; expected 16"):
        DXO.from_bytes(message.SerializeToString())

    bad_kind = _message(dxo_pb2.DATA_KIND_COLLECTION)
    bad_kind.items["site-b"].SetInParent()
    with pytest.raises(InvalidArgument, match="DXO item 'site-b': unknown or unspecified kind 0"):
        DXO.from_proto(bad_kind)


def test_max_elements_reaches_every_tensor() -> None:
    data = DXO(DataKind.WEIGHTS, data={"w": np.ones(100, dtype=np.float32)}).to_bytes()
    assert DXO.from_bytes(data, max_elements=100).data["w"].size == 100
    with pytest.raises(
        InvalidArgument, match="tensor 'w': shape \\[100\\] has 100 elements, more than the limit of 99"
    ):
        DXO.from_bytes(data, max_elements=99)


@pytest.mark.parametrize(
    "data",
    [
        b"\xff",  # a truncated tag
        b"\x12\x05ab",  # a length-delimited field longer than the input
        b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80\x01",  # an over-long varint
        b"\x0b",  # a start-group tag with no end
    ],
    ids=["truncated tag", "short field", "long varint", "open group"],
)
def test_bytes_that_are_not_a_dxo_message_are_refused(data: bytes) -> None:
    with pytest.raises(InvalidArgument, match=r"DXO bytes are not a valid fedlink\.v1\.Dxo message"):
        DXO.from_bytes(data)


@pytest.mark.parametrize(
    ("dxo", "error"),
    [
        (DXO("WEIGHTZ"), r"DXO: unknown kind 'WEIGHTZ'; expected one of WEIGHTS, WEIGHT_DIFF"),  # type: ignore[arg-type]
        (DXO(None), r"DXO: unknown kind None"),  # type: ignore[arg-type]
        (DXO(DataKind.WEIGHTS, data={"w": [1.0, 2.0]}), r"data 'w' is a list, not a numpy array"),  # type: ignore[dict-item]
        (
            DXO(DataKind.WEIGHTS, data={"w": np.zeros(2, np.complex64)}),
            r"tensor 'w': dtype complex64 cannot be sent",
        ),
        (DXO(DataKind.WEIGHTS, data={1: np.zeros(2)}), r"name 1 is not a string"),  # type: ignore[dict-item]
        (DXO(DataKind.METRICS, meta={2: "x"}), r"name 2 is not a string"),  # type: ignore[dict-item]
        (
            DXO(DataKind.WEIGHTS, items={"x": DXO(DataKind.METRICS)}),
            r"items are only for COLLECTION, not WEIGHTS",
        ),
        (DXO(DataKind.COLLECTION, data={"w": np.zeros(1)}), r"a COLLECTION keeps its contents in items"),
        (DXO(DataKind.COLLECTION, items={"x": {"kind": "WEIGHTS"}}), r"item 'x' is a dict, not a DXO"),  # type: ignore[dict-item]
        (
            DXO(DataKind.COLLECTION, items={"a": DXO(DataKind.WEIGHTS, data={"w": "x"})}),  # type: ignore[dict-item]
            r"DXO item 'a': data 'w' is a str",
        ),
        (
            DXO(DataKind.WEIGHTS, encodings={"w": TensorEncoding.SPARSE}),
            r"encoding given for 'w', which is not in data",
        ),
        (
            DXO(DataKind.WEIGHTS, data={"w": np.zeros(1)}, encodings={"w": "zip"}),  # type: ignore[dict-item]
            r"unknown encoding 'zip' for 'w'",
        ),
    ],
)
def test_validate_refuses_malformed_dxos(dxo: DXO, error: str) -> None:
    with pytest.raises(InvalidArgument, match=error):
        dxo.validate()
    with pytest.raises(InvalidArgument, match=error):
        dxo.to_proto()


def test_validate_accepts_plain_strings_for_kind_and_encoding() -> None:
    dxo = DXO("WEIGHTS", data={"w": np.arange(3.0)}, encodings={"w": "sparse"})  # type: ignore[arg-type,dict-item]
    dxo.validate()
    assert dxo.to_proto().data["w"].WhichOneof("encoding") == "sparse"


def test_dict_form_is_nvflares() -> None:
    dxo = weights_dxo()
    d = dxo.to_dict()
    assert d["kind"] == "WEIGHT_DIFF"
    assert type(d["kind"]) is str
    assert d["data"]["layer1.weight"] is dxo.data["layer1.weight"]
    assert d["meta"] == dxo.meta
    back = DXO.from_dict(d)
    assert_same_data(back.data, dxo.data)
    assert_same_meta(back.meta, META)


def test_collection_dict_form_holds_nested_dicts_in_data() -> None:
    top = DXO(DataKind.COLLECTION, items={"m": DXO(DataKind.METRICS, meta={"acc": 0.5})}, meta={"n": 1})
    d = top.to_dict()
    assert d == {
        "kind": "COLLECTION",
        "data": {"m": {"kind": "METRICS", "data": {}, "meta": {"acc": 0.5}}},
        "meta": {"n": 1},
    }
    back = DXO.from_dict(d)
    assert back.items["m"].meta == {"acc": 0.5}
    assert back.data == {}
    assert back.meta == {"n": 1}


def test_from_dict_accepts_edge_json_lists() -> None:
    d = {
        "kind": "WEIGHTS",
        "data": {"w": [[1.0, 2.0], [3.0, 4.5]], "b": [1, 2, 3], "s": 2.0, "flag": [True, False]},
        "meta": {"num_examples": 10},
    }
    dxo = DXO.from_dict(d)
    assert dxo.data["w"].dtype == np.float64
    assert dxo.data["w"].shape == (2, 2)
    assert dxo.data["b"].dtype == np.int64
    assert dxo.data["s"].shape == ()
    assert dxo.data["flag"].dtype == np.bool_
    assert weight_of(dxo) == 10.0
    assert DXO.from_dict({"kind": "METRICS"}).meta == {}


@pytest.mark.parametrize(
    ("d", "error"),
    [
        ([], "a DXO dict must be a mapping, not list"),
        ({"data": {}}, "a DXO dict needs a 'kind'"),
        ({"kind": "weights"}, "unknown kind 'weights'"),
        ({"kind": 1}, "unknown kind 1"),
        ({"kind": "WEIGHTS", "metas": {}}, r"unknown DXO keys \['metas'\]"),
        ({"kind": "WEIGHTS", "data": [1, 2]}, "'data' must be a mapping, not list"),
        ({"kind": "WEIGHTS", "meta": "x"}, "'meta' must be a mapping, not str"),
        ({"kind": "WEIGHTS", "data": {"w": [[1.0], [2.0, 3.0]]}}, "data 'w' is not a rectangular array"),
        ({"kind": "WEIGHTS", "data": {"w": ["a", "b"]}}, "tensor 'w': dtype <U1 cannot be sent"),
        ({"kind": "WEIGHTS", "data": {"w": None}}, "data 'w' is a NoneType, not an array"),
        ({"kind": "COLLECTION", "data": {"x": {"kind": "NOPE"}}}, "DXO item 'x': unknown kind 'NOPE'"),
        ({"kind": "COLLECTION", "data": {"x": 3}}, "DXO item 'x': a DXO dict must be a mapping, not int"),
    ],
)
def test_from_dict_refuses_malformed_dicts(d: Any, error: str) -> None:
    with pytest.raises(InvalidArgument, match=error):
        DXO.from_dict(d)


def test_meta_props_use_nvflares_names() -> None:
    dxo = DXO(DataKind.WEIGHTS)
    assert dxo.get_meta_prop(MetaKey.MODEL_VERSION) is None
    assert dxo.get_meta_prop(MetaKey.MODEL_VERSION, -1) == -1
    dxo.set_meta_prop(MetaKey.MODEL_VERSION, 3)
    assert dxo.get_meta_prop(MetaKey.MODEL_VERSION) == 3
    assert DXO.from_bytes(dxo.to_bytes()).meta == {"model_version": 3}


@pytest.mark.parametrize(
    ("meta", "weight"),
    [
        ({"num_examples": 50}, 50.0),
        ({"num_examples": 2.5}, 2.5),
        ({"num_examples": np.int64(7)}, 7.0),
        ({"num_steps_current_round": 9}, 9.0),
        ({"num_examples": 4, "num_steps_current_round": 9}, 4.0),
    ],
)
def test_weight_is_num_examples_else_num_steps(meta: dict[str, Any], weight: float) -> None:
    result = weight_of(DXO(DataKind.WEIGHT_DIFF, meta=meta))
    assert result == weight
    assert type(result) is float


@pytest.mark.parametrize(
    ("meta", "error"),
    [
        ({}, "neither meta 'num_examples' nor 'num_steps_current_round'"),
        ({"loss": 1.0}, "neither meta 'num_examples'"),
        ({"num_examples": 0}, "'num_examples' must be a finite number > 0 to weigh the result, got 0"),
        ({"num_examples": -3}, "got -3"),
        ({"num_examples": math.nan}, "got nan"),
        ({"num_examples": math.inf}, "got inf"),
        ({"num_examples": "10"}, "'num_examples' must be a number > 0, got str '10'"),
        ({"num_examples": True}, "got bool True"),
        ({"num_examples": None}, "got NoneType None"),
        # A present but invalid num_examples does not fall back to the step count.
        ({"num_examples": 0, "num_steps_current_round": 5}, "'num_examples' must be a finite number > 0"),
        ({"num_steps_current_round": -1}, "'num_steps_current_round' must be a finite number > 0"),
    ],
)
def test_weight_refuses_missing_or_unusable_values(meta: dict[str, Any], error: str) -> None:
    with pytest.raises(InvalidArgument, match=error):
        weight_of(DXO(DataKind.WEIGHT_DIFF, meta=meta))
