"""The tensor element types fedlink puts on the wire, and how they map to numpy dtypes.

Wire bytes are always little-endian. Every numpy dtype used here to read or write them is spelled with
an explicit ``<`` so the code is correct on any host; on a little-endian host these are the native
dtypes, so decoding costs no byte swap.

bfloat16 needs the optional ``ml_dtypes`` package (``pip install 'fedlink[bfloat16]'``). Without it a
bfloat16 tensor still decodes, but widened to float32: every bfloat16 value is exactly representable
in float32, so nothing is lost, and numpy arithmetic on the result (e.g. averaging) is correct. We chose
this over handing out the raw bits as uint16, which numpy would happily average into nonsense. The
price: the array is twice the size, and re-encoding it sends float32 unless the sender has ml_dtypes.

ml_dtypes is imported the first time bfloat16 is needed (a bfloat16 tensor decoded, or ``BFLOAT16``
read), not with this module: its import takes a second or more, and most processes (the runner, the
CLI) never see a bfloat16 tensor.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from fedlink.common.errors import InvalidArgument

# The bfloat16 dtype when ml_dtypes is installed, else None. Not set at import: the first read of
# ``dtypes.BFLOAT16`` (module __getattr__) or _bfloat16() loads ml_dtypes and sets it. Read at call
# time (never copied), so a test may set it to None to exercise the fallback.
BFLOAT16: np.dtype[np.void] | None


def _load_bfloat16() -> np.dtype[np.void] | None:
    try:
        from ml_dtypes import bfloat16
    except ImportError:  # pragma: no cover - the dev environment has it
        value = None
    else:
        value = np.dtype(bfloat16)
    globals()["BFLOAT16"] = value
    return value


def _bfloat16() -> np.dtype[np.void] | None:
    """``BFLOAT16``, loading ml_dtypes on first use (or what a test set it to)."""
    value = globals().get("BFLOAT16", _UNSET)
    return _load_bfloat16() if value is _UNSET else value


if not TYPE_CHECKING:  # mypy sees the annotation above; a __getattr__ would hide misspelt names from it

    def __getattr__(name: str) -> Any:
        """``BFLOAT16`` on first read (PEP 562): ml_dtypes is imported then, not with the module."""
        if name == "BFLOAT16":
            return _load_bfloat16()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_UNSET: Final = object()

# Wire name -> little-endian dtype of one element on the wire. bfloat16 is read as its raw bits.
_WIRE_DTYPES: Final[dict[str, np.dtype[np.generic]]] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "bfloat16": np.dtype("<u2"),
    "int8": np.dtype("i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
    "uint64": np.dtype("<u8"),
    "bool": np.dtype("?"),
}

# (numpy kind, itemsize) -> wire name, so that any byte order or alias (longlong, intc...) is found.
_NAME_BY_KIND: Final[dict[tuple[str, int], str]] = {
    (dt.kind, dt.itemsize): name for name, dt in _WIRE_DTYPES.items() if name != "bfloat16"
}

SUPPORTED_DTYPES: Final[frozenset[str]] = frozenset(_WIRE_DTYPES)
"""Every dtype name a :class:`fedlink.v1.dxo_pb2.Tensor` may carry."""

FLOAT_DTYPES: Final[frozenset[str]] = frozenset({"float16", "float32", "float64", "bfloat16"})
"""The dtypes the float16 wire encoding may carry."""


def check_dtype_name(name: str, *, tensor: str = "") -> None:
    """Raise InvalidArgument unless ``name`` is a supported wire dtype.

    Args:
        name: The dtype name from the wire.
        tensor: The tensor's name, for the error message.
    """
    if name not in _WIRE_DTYPES:
        expected = ", ".join(sorted(SUPPORTED_DTYPES))
        raise InvalidArgument(f"{_label(tensor)}unknown dtype {name!r}; expected one of {expected}")


def native_bfloat16() -> np.dtype[np.void] | None:
    """The bfloat16 dtype that decoded tensors use, or None when they are widened to float32."""
    # On a big-endian host ml_dtypes' native bfloat16 cannot view little-endian bytes directly;
    # we take the (exact) float32 path there rather than carry untested byte-swapping code.
    return _bfloat16() if sys.byteorder == "little" else None


def wire_dtype(name: str) -> np.dtype[np.generic]:
    """The little-endian dtype of one wire element of ``name`` (bfloat16: its raw bits, ``<u2``)."""
    return _WIRE_DTYPES[name]


def decoded_dtype(name: str) -> np.dtype[np.generic]:
    """The dtype a decoded tensor of wire dtype ``name`` has (bfloat16 without ml_dtypes: float32)."""
    if name == "bfloat16":
        bf16 = native_bfloat16()
        return bf16 if bf16 is not None else np.dtype("<f4")
    return _WIRE_DTYPES[name]


def dtype_name(dtype: np.dtype[np.generic], *, tensor: str = "") -> str:
    """The wire name of a numpy dtype, in any byte order.

    Raises:
        InvalidArgument: The dtype has no wire form (complex, object, strings, float128, ...).
    """
    # Only ml_dtypes makes a dtype named bfloat16: when there is none, it need not be loaded to know.
    if dtype.name == "bfloat16" and dtype == _bfloat16():
        return "bfloat16"
    name = _NAME_BY_KIND.get((dtype.kind, dtype.itemsize)) if dtype.kind in "biuf" else None
    if name is None:
        expected = ", ".join(sorted(SUPPORTED_DTYPES))
        raise InvalidArgument(f"{_label(tensor)}dtype {dtype} cannot be sent; use one of {expected}")
    return name


def to_wire_layout(array: npt.NDArray[np.generic], name: str) -> npt.NDArray[np.generic]:
    """``array`` as a C-contiguous array of little-endian wire elements (a view when it is one already)."""
    if name == "bfloat16":
        # Reinterpret as the raw bits; '=u2' -> '<u2' is a no-op on little-endian hosts.
        array = array.view(np.dtype("=u2"))
    return np.asarray(array, dtype=_WIRE_DTYPES[name], order="C")


def bfloat16_bits_to_float32(bits: npt.NDArray[np.generic]) -> npt.NDArray[np.float32]:
    """Widen raw bfloat16 bits (any unsigned 16-bit array) to float32, exactly."""
    # bfloat16 is the upper half of a float32: shift the 16 bits into place.
    widened = (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return widened


def _label(tensor: str) -> str:
    return f"tensor {tensor!r}: " if tensor else "tensor: "
