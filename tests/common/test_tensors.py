"""Tests for the tensor wire encodings in fedlink.common.tensors (and the dtype table behind them)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedlink.common import dtypes
from fedlink.common.errors import InvalidArgument
from fedlink.common.tensors import (
    MAX_TENSOR_ELEMENTS,
    SUPPORTED_DTYPES,
    TensorEncoding,
    decode_tensor,
    encode_tensor,
    tensor_encoding,
    tensor_nbytes,
)
from fedlink.v1 import dxo_pb2

BF16 = np.dtype(ml_dtypes.bfloat16)
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    name: BF16 if name == "bfloat16" else np.dtype(name) for name in sorted(SUPPORTED_DTYPES)
}
FLOAT_NAMES = ["bfloat16", "float16", "float32", "float64"]
SHAPES: list[tuple[int, ...]] = [(), (0,), (1,), (7,), (3, 4), (2, 0, 3), (2, 3, 1, 2)]


def sample(dtype: np.dtype[Any], shape: tuple[int, ...], seed: int = 0) -> npt.NDArray[Any]:
    """An array of ``dtype`` with varied values, about a third of them zero."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    if dtype.kind == "b":
        values: npt.NDArray[Any] = rng.random(size) < 0.5
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        values = rng.integers(info.min, info.max, size=size, endpoint=True, dtype=dtype)
    else:
        values = (rng.standard_normal(size) * 100).astype(dtype)
    values[rng.random(size) < 0.33] = 0
    return values.astype(dtype).reshape(shape)


def assert_identical(actual: npt.NDArray[Any], expected: npt.NDArray[Any]) -> None:
    """Same dtype, same shape, same bits."""
    assert actual.dtype == expected.dtype
    assert actual.shape == expected.shape
    assert actual.tobytes() == np.ascontiguousarray(expected).tobytes()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(SUPPORTED_DTYPES))
@pytest.mark.parametrize("encoding", [TensorEncoding.DENSE, TensorEncoding.SPARSE])
def test_exact_encodings_round_trip_bit_for_bit(
    encoding: TensorEncoding, name: str, shape: tuple[int, ...]
) -> None:
    array = sample(NUMPY_DTYPES[name], shape)
    message = encode_tensor(array, encoding)
    assert message.dtype == name
    assert list(message.shape) == list(shape)
    assert tensor_encoding(message) is encoding
    decoded = decode_tensor(message, name="w")
    assert_identical(decoded, array)
    assert tensor_nbytes(message) == decoded.nbytes


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", FLOAT_NAMES)
def test_float16_round_trip_widens_back_within_float16_precision(name: str, shape: tuple[int, ...]) -> None:
    array = sample(NUMPY_DTYPES[name], shape)
    message = encode_tensor(array, TensorEncoding.FLOAT16)
    assert len(message.float16.data) == 2 * array.size
    decoded = decode_tensor(message)
    assert decoded.dtype == array.dtype
    assert_identical(decoded, array.astype(np.float16).astype(array.dtype))
    np.testing.assert_allclose(
        decoded.astype(np.float64), array.astype(np.float64), rtol=2**-8 if name == "bfloat16" else 2**-10
    )
    assert tensor_nbytes(message) == decoded.nbytes


def test_float16_passes_inf_and_nan_through() -> None:
    array = np.array([np.inf, -np.inf, np.nan, 1.5], dtype=np.float32)
    decoded = decode_tensor(encode_tensor(array, TensorEncoding.FLOAT16))
    np.testing.assert_array_equal(decoded, array)


@pytest.mark.parametrize("value", [70000.0, -1e6, 65520.0])
def test_float16_refuses_values_beyond_its_range(value: float) -> None:
    # 65520 is finite in float32 but rounds to infinity in float16.
    with pytest.raises(InvalidArgument, match=r"tensor 'big': .*float16's range"):
        encode_tensor(np.array([1.0, value], dtype=np.float32), TensorEncoding.FLOAT16, name="big")


@pytest.mark.parametrize("name", ["int8", "int64", "uint8", "bool"])
def test_float16_encoding_of_a_non_float_dtype_is_refused_both_ways(name: str) -> None:
    array = sample(NUMPY_DTYPES[name], (4,))
    with pytest.raises(
        InvalidArgument, match=rf"tensor 'x': float16 encoding is only for float dtypes, not {name}"
    ):
        encode_tensor(array, TensorEncoding.FLOAT16, name="x")
    forged = dxo_pb2.Tensor(dtype=name, shape=[4], float16=dxo_pb2.Float16Encoding(data=b"\0" * 8))
    with pytest.raises(
        InvalidArgument, match=rf"tensor 'x': float16 encoding is only for float dtypes, not {name}"
    ):
        decode_tensor(forged, name="x")


def test_wire_bytes_are_little_endian_and_row_major_whatever_the_input_layout() -> None:
    base = np.arange(12, dtype=np.int32).reshape(3, 4)
    expected = b"".join(int(v).to_bytes(4, "little") for v in base.ravel(order="C"))
    for variant in (
        base,
        base.astype(">i4"),
        np.asfortranarray(base),
        np.asfortranarray(base.astype(">i4")),
    ):
        assert encode_tensor(variant).dense.data == expected
    strided = np.arange(24, dtype=">f8").reshape(3, 8)[:, ::2]
    assert not strided.flags.c_contiguous
    message = encode_tensor(strided)
    assert message.dense.data == np.ascontiguousarray(strided, dtype="<f8").tobytes()
    assert_identical(decode_tensor(message), strided.astype(np.float64))


def test_sparse_wire_form_is_flat_int64_indices_and_values() -> None:
    array = np.array([[0, 5, 0], [0, 0, -7]], dtype=">i2")
    sparse = encode_tensor(array, TensorEncoding.SPARSE).sparse
    assert sparse.indices == np.array([1, 5], dtype="<i8").tobytes()
    assert sparse.values == np.array([5, -7], dtype="<i2").tobytes()


def test_sparse_keeps_negative_zero_and_nan() -> None:
    array = np.array([0.0, -0.0, np.nan, 0.0, 2.0], dtype=np.float32)
    message = encode_tensor(array, TensorEncoding.SPARSE)
    assert np.frombuffer(message.sparse.indices, dtype="<i8").tolist() == [1, 2, 4]
    assert_identical(decode_tensor(message), array)


def test_sparse_of_all_zeros_sends_nothing() -> None:
    message = encode_tensor(np.zeros((100, 10), dtype=np.float64), TensorEncoding.SPARSE)
    assert message.sparse.indices == b""
    assert message.sparse.values == b""
    assert_identical(decode_tensor(message), np.zeros((100, 10)))


def test_dense_decode_is_a_read_only_view_of_the_message_bytes() -> None:
    array = np.arange(1000, dtype=np.float32).reshape(10, 100)
    decoded = decode_tensor(encode_tensor(array))
    assert not decoded.flags.owndata
    assert not decoded.flags.writeable
    base: object = decoded
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, bytes)
    assert len(base) == array.nbytes


def test_float16_and_sparse_decodes_are_writable() -> None:
    array = np.arange(6, dtype=np.float32)
    for encoding in (TensorEncoding.FLOAT16, TensorEncoding.SPARSE):
        decoded = decode_tensor(encode_tensor(array, encoding))
        decoded[0] = 1.0
        assert decoded[0] == 1.0


def test_numpy_scalar_encodes_as_a_zero_dimensional_tensor() -> None:
    message = encode_tensor(np.float64(2.5))
    assert list(message.shape) == []
    decoded = decode_tensor(message)
    assert decoded.shape == ()
    assert decoded.dtype == np.float64
    assert float(decoded) == 2.5


@pytest.mark.parametrize(
    "array",
    [
        np.zeros(2, dtype=np.complex64),
        np.array(["a", "b"]),
        np.array([object()], dtype=object),
        np.zeros(2, dtype="datetime64[s]"),
        np.zeros(2, dtype=np.longdouble),
        np.zeros(2, dtype=ml_dtypes.float8_e4m3fn),
    ],
    ids=lambda a: str(a.dtype),
)
def test_unsupported_dtypes_cannot_be_encoded(array: npt.NDArray[Any]) -> None:
    if array.dtype == np.float64:  # longdouble is float64 on some platforms: then it is supported
        pytest.skip("longdouble is float64 here")
    with pytest.raises(InvalidArgument, match=r"tensor 'v': dtype .* cannot be sent"):
        encode_tensor(array, name="v")


def test_encode_refuses_non_arrays_and_unknown_encodings() -> None:
    with pytest.raises(InvalidArgument, match="expected a numpy array, got list"):
        encode_tensor([1.0, 2.0], name="v")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="unknown tensor encoding 'zip'"):
        encode_tensor(np.zeros(2), "zip", name="v")  # type: ignore[arg-type]
    assert encode_tensor(np.zeros(2), "sparse").WhichOneof("encoding") == "sparse"  # type: ignore[arg-type]


def _dense(dtype: str, shape: list[int], data: bytes) -> dxo_pb2.Tensor:
    return dxo_pb2.Tensor(dtype=dtype, shape=shape, dense=dxo_pb2.DenseEncoding(data=data))


def _sparse(
    shape: list[int], indices: list[int], values: list[float], dtype: str = "float32"
) -> dxo_pb2.Tensor:
    return dxo_pb2.Tensor(
        dtype=dtype,
        shape=shape,
        sparse=dxo_pb2.SparseEncoding(
            indices=np.array(indices, dtype="<i8").tobytes(), values=np.array(values, dtype=dtype).tobytes()
        ),
    )


BAD_TENSORS: list[tuple[str, dxo_pb2.Tensor, str]] = [
    (
        "unknown dtype",
        _dense("complex64", [1], b"\0" * 8),
        r"unknown dtype 'complex64'; expected one of bfloat16, bool",
    ),
    ("empty dtype", _dense("", [1], b"\0"), r"unknown dtype ''"),
    ("numpy alias", _dense("f4", [1], b"\0" * 4), r"unknown dtype 'f4'"),
    ("negative dim", _dense("float32", [2, -1], b""), r"negative dimension in shape \[2, -1\]"),
    (
        "absurd dims",
        _dense("float32", [2**20, 2**20], b""),
        r"shape \[1048576, 1048576\] has 1099511627776 elements, more than the limit of 2147483648$",
    ),
    (
        "overflowing dims",
        _dense("uint8", [2**62, 2**62, 16], b""),
        r"shape .* has 340282366920938463463374607431768211456 elements",
    ),
    ("too many dims", _dense("uint8", [1] * 65, b"\0"), r"65 dimensions; at most 64"),
    ("no encoding", dxo_pb2.Tensor(dtype="float32", shape=[1]), r"no encoding set"),
    (
        "dense too short",
        _dense("float32", [2, 2], b"\0" * 15),
        r"dense data is 15 bytes; expected 16 \(4 × 4\)",
    ),
    ("dense too long", _dense("int64", [1], b"\0" * 9), r"dense data is 9 bytes; expected 8"),
    ("dense scalar empty", _dense("float64", [], b""), r"dense data is 0 bytes; expected 8"),
    (
        "float16 length",
        dxo_pb2.Tensor(dtype="float32", shape=[3], float16=dxo_pb2.Float16Encoding(data=b"\0" * 4)),
        r"float16 data is 4 bytes; expected 6",
    ),
    (
        "indices not int64",
        dxo_pb2.Tensor(dtype="float32", shape=[3], sparse=dxo_pb2.SparseEncoding(indices=b"\0" * 7)),
        r"sparse indices are 7 bytes, not a multiple of 8",
    ),
    ("index too big", _sparse([2, 2], [1, 4], [1.0, 2.0]), r"sparse index 4 is out of range \[0, 4\)"),
    ("index negative", _sparse([4], [-1, 2], [1.0, 2.0]), r"sparse index -1 is out of range \[0, 4\)"),
    ("index into empty", _sparse([0], [0], [1.0]), r"sparse index 0 is out of range \[0, 0\)"),
    (
        "duplicate index",
        _sparse([4], [0, 2, 2], [1.0, 2.0, 3.0]),
        r"sparse indices must be strictly increasing; position 2 holds 2 after 2",
    ),
    (
        "decreasing index",
        _sparse([4], [3, 1], [1.0, 2.0]),
        r"sparse indices must be strictly increasing; position 1 holds 1 after 3",
    ),
    (
        "values too short",
        dxo_pb2.Tensor(
            dtype="float64",
            shape=[4],
            sparse=dxo_pb2.SparseEncoding(indices=np.array([0, 1], "<i8").tobytes(), values=b"\0" * 8),
        ),
        r"sparse values is 8 bytes; expected 16 \(2 indices × 8\)",
    ),
]


@pytest.mark.parametrize(
    ("message", "error"), [case[1:] for case in BAD_TENSORS], ids=[c[0] for c in BAD_TENSORS]
)
def test_malformed_tensors_are_refused_with_a_message_naming_the_tensor(
    message: dxo_pb2.Tensor, error: str
) -> None:
    with pytest.raises(InvalidArgument, match=r"^tensor 'layer1\.weight': " + error):
        decode_tensor(message, name="layer1.weight")


def test_max_elements_bounds_every_encoding_before_allocating() -> None:
    array = np.ones((2, 5), dtype=np.float32)
    for encoding in TensorEncoding:
        message = encode_tensor(array, encoding)
        assert decode_tensor(message, max_elements=10).shape == (2, 5)
        with pytest.raises(InvalidArgument, match="10 elements, more than the limit of 9"):
            decode_tensor(message, max_elements=9)
    # A sparse tensor is tiny on the wire but would allocate its whole dense shape.
    huge = _sparse([MAX_TENSOR_ELEMENTS + 1], [0], [1.0])
    with pytest.raises(InvalidArgument, match="more than the limit"):
        decode_tensor(huge)


def test_tensor_nbytes_is_computed_without_decoding() -> None:
    absurd = _dense("float64", [2**40, 2**40], b"")
    assert tensor_nbytes(absurd) == 8 * 2**80
    with pytest.raises(InvalidArgument, match="unknown dtype"):
        tensor_nbytes(_dense("complex128", [1], b""), name="c")
    with pytest.raises(InvalidArgument, match="negative dimension"):
        tensor_nbytes(_dense("float64", [-3], b""))


def test_unsupported_dtype_error_lists_the_supported_ones() -> None:
    with pytest.raises(InvalidArgument) as info:
        decode_tensor(_dense("float8", [1], b"\0"), name="v")
    for name in SUPPORTED_DTYPES:
        assert name in info.value.message


class TestBfloat16WithoutMlDtypes:
    """Without ml_dtypes, bfloat16 tensors decode exactly, widened to float32."""

    @pytest.fixture(autouse=True)
    def _no_ml_dtypes(self, monkeypatch: pytest.MonkeyPatch) -> None:
        # ml_dtypes is third-party: we simulate its absence through the module's availability flag.
        monkeypatch.setattr(dtypes, "BFLOAT16", None)

    @pytest.mark.parametrize("encoding", list(TensorEncoding))
    def test_bfloat16_decodes_to_float32_with_the_same_values(self, encoding: TensorEncoding) -> None:
        array = sample(BF16, (3, 5))
        message = encode_tensor_with_ml_dtypes(array, encoding)
        decoded = decode_tensor(message)
        expected = array.astype(np.float32)
        if encoding is TensorEncoding.FLOAT16:
            expected = array.astype(np.float16).astype(np.float32)
        assert_identical(decoded, expected)
        assert tensor_nbytes(message) == decoded.nbytes == 4 * array.size

    def test_every_bfloat16_bit_pattern_widens_exactly(self) -> None:
        bits = np.arange(2**16, dtype=np.uint32).astype("<u2")
        widened = dtypes.bfloat16_bits_to_float32(bits)
        reference = bits.view(BF16).astype(np.float32)
        finite = np.isfinite(reference)
        assert widened.view(np.uint32)[finite].tolist() == reference.view(np.uint32)[finite].tolist()
        np.testing.assert_array_equal(np.isnan(widened), np.isnan(reference))
        np.testing.assert_array_equal(widened[np.isinf(reference)], reference[np.isinf(reference)])

    def test_a_bfloat16_array_cannot_be_recognised_so_it_is_refused(self) -> None:
        with pytest.raises(InvalidArgument, match="cannot be sent"):
            encode_tensor(np.zeros(2, dtype=BF16), name="w")


def encode_tensor_with_ml_dtypes(array: npt.NDArray[Any], encoding: TensorEncoding) -> dxo_pb2.Tensor:
    """Encode as a sender with ml_dtypes would (the wire form does not depend on the receiver)."""
    bits = np.ascontiguousarray(array).view("<u2")
    shape = list(array.shape)
    if encoding is TensorEncoding.DENSE:
        return dxo_pb2.Tensor(dtype="bfloat16", shape=shape, dense=dxo_pb2.DenseEncoding(data=bits.tobytes()))
    if encoding is TensorEncoding.FLOAT16:
        half = array.astype("<f2").tobytes()
        return dxo_pb2.Tensor(dtype="bfloat16", shape=shape, float16=dxo_pb2.Float16Encoding(data=half))
    flat = bits.reshape(-1)
    indices = np.flatnonzero(flat)
    sparse = dxo_pb2.SparseEncoding(indices=indices.astype("<i8").tobytes(), values=flat[indices].tobytes())
    return dxo_pb2.Tensor(dtype="bfloat16", shape=shape, sparse=sparse)


def test_bfloat16_with_ml_dtypes_decodes_as_bfloat16_without_copying() -> None:
    array = sample(BF16, (4, 4))
    decoded = decode_tensor(encode_tensor(array))
    assert decoded.dtype == BF16
    assert not decoded.flags.owndata
    assert_identical(decoded, array)


HYPOTHESIS_DTYPES = [np.dtype(name) for name in sorted(SUPPORTED_DTYPES - {"bfloat16"})]


@st.composite
def arrays_and_encodings(draw: st.DrawFn) -> tuple[npt.NDArray[Any], TensorEncoding]:
    dtype = draw(st.sampled_from(HYPOTHESIS_DTYPES))
    if dtype.itemsize > 1:
        dtype = draw(st.sampled_from([dtype, dtype.newbyteorder(">")]))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6))
    array = draw(hnp.arrays(dtype, shape))
    if draw(st.booleans()) and array.ndim >= 2:
        array = array.T  # not C-contiguous
    choices = list(TensorEncoding) if dtype.kind == "f" else [TensorEncoding.DENSE, TensorEncoding.SPARSE]
    return array, draw(st.sampled_from(choices))


@settings(max_examples=300, deadline=None)
@given(arrays_and_encodings())
def test_property_every_array_round_trips(case: tuple[npt.NDArray[Any], TensorEncoding]) -> None:
    array, encoding = case
    native = array.astype(array.dtype.newbyteorder("="))
    if encoding is TensorEncoding.FLOAT16:
        with np.errstate(over="ignore"):
            expected = native.astype(np.float16).astype(native.dtype)
        if np.any(np.isinf(expected) & np.isfinite(native)):
            with pytest.raises(InvalidArgument, match="float16's range"):
                encode_tensor(array, encoding)
            return
    else:
        expected = native
    message = encode_tensor(array, encoding)
    decoded = decode_tensor(message)
    assert tensor_nbytes(message) == decoded.nbytes
    assert decoded.dtype == expected.dtype
    assert decoded.shape == expected.shape
    if encoding is TensorEncoding.FLOAT16:
        # float16 -> float64 widening is exact; NaN payloads are not promised through a cast.
        np.testing.assert_array_equal(decoded, expected)
    else:
        assert decoded.tobytes() == np.ascontiguousarray(expected).tobytes()
