"""Tensor wire encodings: numpy arrays to and from ``fedlink.v1.Tensor`` (dense, float16, sparse).

A tensor travels as its dtype name, its shape and little-endian, row-major element bytes in one of
three encodings:

* ``dense``: every element in ``dtype``;
* ``float16``: every element rounded to IEEE binary16, widened back to ``dtype`` by the receiver (only
  for float dtypes; a value outside float16's range is refused rather than sent as infinity);
* ``sparse``: the flat int64 indices of the non-zero elements (strictly increasing) and their values.

Copies: encoding makes one ``tobytes()`` copy (plus a byte swap for a big-endian input array). Decoding
a dense tensor makes no copy beyond the one the protobuf runtime makes when the bytes field is read: the
array is an ``np.frombuffer`` view of those bytes and is therefore **read-only**; call ``np.array(x)``
(or ``x.copy()``) before changing it in place. Float16 and sparse tensors decode into fresh, writable
arrays. On a big-endian host decoded arrays keep a little-endian dtype (correct, if slower to compute
with); bfloat16 is documented in :mod:`fedlink.common.dtypes`.

Every malformed tensor raises :class:`~fedlink.common.errors.InvalidArgument` naming the tensor.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from fedlink.common import dtypes
from fedlink.common.dtypes import FLOAT_DTYPES, SUPPORTED_DTYPES
from fedlink.common.errors import InvalidArgument
from fedlink.v1 import dxo_pb2

__all__ = [
    "MAX_TENSOR_ELEMENTS",
    "SUPPORTED_DTYPES",
    "TensorEncoding",
    "check_sparse_count",
    "decode_tensor",
    "element_count",
    "encode_tensor",
    "fill_tensor",
    "tensor_encoding",
    "tensor_nbytes",
]

MAX_TENSOR_ELEMENTS: Final[int] = 2**31
"""Default upper bound on a decoded tensor's element count: a sanity bound against absurd shapes, not a
size policy (callers enforce byte limits with :func:`tensor_nbytes`)."""

# numpy arrays have at most 64 dimensions (NPY_MAXDIMS in numpy 2).
_MAX_DIMS: Final[int] = 64
_INDEX_DTYPE: Final = np.dtype("<i8")
_FLOAT16_DTYPE: Final = np.dtype("<f2")


class TensorEncoding(enum.StrEnum):
    """How a tensor's elements are laid out on the wire (the ``Tensor.encoding`` oneof)."""

    DENSE = "dense"
    FLOAT16 = "float16"
    SPARSE = "sparse"


def encode_tensor(
    array: npt.NDArray[np.generic] | np.generic,
    encoding: TensorEncoding = TensorEncoding.DENSE,
    *,
    name: str = "",
) -> dxo_pb2.Tensor:
    """Encode a numpy array as a wire tensor.

    Args:
        array: Any supported dtype, any byte order, contiguous or not; a numpy scalar is a 0-d tensor.
        encoding: The wire encoding.
        name: The tensor's name, for error messages.

    Returns:
        A new ``Tensor`` message.

    Raises:
        InvalidArgument: Not an array, an unsupported dtype, float16 encoding of a non-float dtype, or
            float16 encoding of a value outside float16's range.
    """
    message = dxo_pb2.Tensor()
    fill_tensor(message, array, encoding, name=name)
    return message


def fill_tensor(
    message: dxo_pb2.Tensor,
    array: npt.NDArray[np.generic] | np.generic,
    encoding: TensorEncoding = TensorEncoding.DENSE,
    *,
    name: str = "",
) -> None:
    """Like :func:`encode_tensor`, but writes into ``message`` (e.g. a map entry) to avoid copying it."""
    if isinstance(array, np.generic):
        array = np.asarray(array)
    if not isinstance(array, np.ndarray):
        raise InvalidArgument(f"{_label(name)}expected a numpy array, got {type(array).__name__}")
    try:
        encoding = TensorEncoding(encoding)
    except ValueError:
        raise InvalidArgument(f"{_label(name)}unknown tensor encoding {encoding!r}") from None
    dtype_name = dtypes.dtype_name(array.dtype, tensor=name)
    message.Clear()
    message.dtype = dtype_name
    message.shape.extend(array.shape)
    if encoding is TensorEncoding.DENSE:
        message.dense.data = dtypes.to_wire_layout(array, dtype_name).tobytes()
    elif encoding is TensorEncoding.FLOAT16:
        message.float16.data = _to_float16(array, dtype_name, name).tobytes()
    else:
        flat = dtypes.to_wire_layout(array, dtype_name).reshape(-1)
        # Test the raw bits, not the values, so -0.0 survives the round trip bit for bit.
        indices = np.flatnonzero(flat.view(np.dtype(f"u{flat.itemsize}")))
        message.sparse.indices = indices.astype(_INDEX_DTYPE, copy=False).tobytes()
        message.sparse.values = flat[indices].tobytes()


def decode_tensor(
    message: dxo_pb2.Tensor, *, name: str = "", max_elements: int = MAX_TENSOR_ELEMENTS
) -> npt.NDArray[np.generic]:
    """Decode a wire tensor into a numpy array of its dtype and shape.

    Args:
        message: The tensor.
        name: The tensor's name, for error messages.
        max_elements: Refuse shapes with more elements than this (before allocating anything).

    Returns:
        The array. A dense tensor gives a read-only view of the message's bytes (see the module notes).

    Raises:
        InvalidArgument: Unknown dtype, bad or absurd shape, no encoding, byte lengths that do not match
            dtype and shape, float16 encoding of a non-float dtype, or sparse indices that are out of
            range or not strictly increasing.
    """
    count = _element_count(message, name, max_elements)
    dtype_name = message.dtype
    shape = tuple(message.shape)
    kind = tensor_encoding(message, name=name)
    if kind is TensorEncoding.DENSE:
        wire = dtypes.wire_dtype(dtype_name)
        data = message.dense.data
        _check_length(len(data), count * wire.itemsize, "dense data", name, f"{count} × {wire.itemsize}")
        return _to_host(np.frombuffer(data, dtype=wire), dtype_name).reshape(shape)
    if kind is TensorEncoding.FLOAT16:
        if dtype_name not in FLOAT_DTYPES:
            raise InvalidArgument(
                f"{_label(name)}float16 encoding is only for float dtypes, not {dtype_name}"
            )
        data = message.float16.data
        _check_length(len(data), count * 2, "float16 data", name, f"{count} × 2")
        half = np.frombuffer(data, dtype=_FLOAT16_DTYPE)
        return half.astype(dtypes.decoded_dtype(dtype_name)).reshape(shape)
    return _decode_sparse(message.sparse, dtype_name, count, name).reshape(shape)


def tensor_encoding(message: dxo_pb2.Tensor, *, name: str = "") -> TensorEncoding:
    """Which encoding a wire tensor uses.

    Raises:
        InvalidArgument: None is set.
    """
    kind = message.WhichOneof("encoding")
    if kind is None:
        raise InvalidArgument(f"{_label(name)}no encoding set (expected one of dense, float16, sparse)")
    return TensorEncoding(kind)


def tensor_nbytes(message: dxo_pb2.Tensor, *, name: str = "") -> int:
    """The size in bytes of the array :func:`decode_tensor` would return, without decoding it.

    Raises:
        InvalidArgument: Unknown dtype or a negative dimension.
    """
    count = _element_count(message, name, max_elements=None)
    return count * dtypes.decoded_dtype(message.dtype).itemsize


def _element_count(message: dxo_pb2.Tensor, name: str, max_elements: int | None) -> int:
    return element_count(message.dtype, message.shape, name=name, max_elements=max_elements)


def element_count(
    dtype_name: str, shape: Sequence[int], *, name: str = "", max_elements: int | None = None
) -> int:
    """The number of elements of a tensor of ``shape``, after checking its dtype name and shape.

    Raises:
        InvalidArgument: Unknown dtype, too many or negative dimensions, or more than ``max_elements``.
    """
    dtypes.check_dtype_name(dtype_name, tensor=name)
    if len(shape) > _MAX_DIMS:
        raise InvalidArgument(f"{_label(name)}{len(shape)} dimensions; at most {_MAX_DIMS} are allowed")
    if any(dim < 0 for dim in shape):
        raise InvalidArgument(f"{_label(name)}negative dimension in shape {list(shape)}")
    # Python integers do not overflow, so an absurd shape gives an absurd count, which we refuse.
    count = math.prod(shape)
    if max_elements is not None and count > max_elements:
        raise InvalidArgument(
            f"{_label(name)}shape {list(shape)} has {count} elements, more than the limit of {max_elements}"
        )
    return count


def _decode_sparse(
    sparse: dxo_pb2.SparseEncoding, dtype_name: str, count: int, name: str
) -> npt.NDArray[np.generic]:
    index_bytes = sparse.indices
    if len(index_bytes) % _INDEX_DTYPE.itemsize:
        raise InvalidArgument(
            f"{_label(name)}sparse indices are {len(index_bytes)} bytes, not a multiple of 8 (int64)"
        )
    indices = np.frombuffer(index_bytes, dtype=_INDEX_DTYPE)
    wire = dtypes.wire_dtype(dtype_name)
    value_bytes = sparse.values
    k = indices.size
    _check_length(
        len(value_bytes), k * wire.itemsize, "sparse values", name, f"{k} indices × {wire.itemsize}"
    )
    if k:
        # Strictly increasing indices are all in range when the first and last are; an index out of
        # order but in range is caught by the ordering check below.
        if indices[0] < 0 or indices[-1] >= count:
            bad = int(indices[(indices < 0) | (indices >= count)][0])
            raise InvalidArgument(f"{_label(name)}sparse index {bad} is out of range [0, {count})")
        check_sparse_count(k, count, name)  # before the ordering check reads every index
        if k > 1:
            steps = np.flatnonzero(indices[1:] <= indices[:-1])
            if steps.size:
                at = int(steps[0])
                raise InvalidArgument(
                    f"{_label(name)}sparse indices must be strictly increasing; "
                    f"position {at + 1} holds {int(indices[at + 1])} after {int(indices[at])}"
                )
    values = np.frombuffer(value_bytes, dtype=wire)
    dense = np.zeros(count, dtype=wire)
    dense[indices] = values
    return _to_host(dense, dtype_name)


def check_sparse_count(k: int, count: int, name: str = "") -> None:
    """Refuses more sparse indices than the dense tensor has elements (before any is read).

    Raises:
        InvalidArgument: ``k`` exceeds ``count``.
    """
    if k > count:
        raise InvalidArgument(f"{_label(name)}{k} sparse indices for a tensor of {count} elements")


def _to_host(array: npt.NDArray[np.generic], dtype_name: str) -> npt.NDArray[np.generic]:
    """Reinterpret wire elements as the decoded dtype (only bfloat16 differs from the wire dtype)."""
    if dtype_name != "bfloat16":
        return array
    bf16 = dtypes.native_bfloat16()
    if bf16 is not None:
        return array.view(bf16)
    return dtypes.bfloat16_bits_to_float32(array)


def _to_float16(array: npt.NDArray[np.generic], dtype_name: str, name: str) -> npt.NDArray[np.generic]:
    if dtype_name not in FLOAT_DTYPES:
        raise InvalidArgument(f"{_label(name)}float16 encoding is only for float dtypes, not {dtype_name}")
    # The cast raises on overflow instead of silently sending infinity (inputs already inf/NaN pass).
    with np.errstate(over="raise", invalid="ignore"):
        try:
            return np.asarray(array, dtype=_FLOAT16_DTYPE, order="C")
        except FloatingPointError:
            raise InvalidArgument(
                f"{_label(name)}values exceed float16's range (±65504); send this tensor dense"
            ) from None


def _check_length(actual: int, expected: int, what: str, name: str, formula: str) -> None:
    if actual != expected:
        raise InvalidArgument(f"{_label(name)}{what} is {actual} bytes; expected {expected} ({formula})")


def _label(name: str) -> str:
    return f"tensor {name!r}: " if name else "tensor: "
