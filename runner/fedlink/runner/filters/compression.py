"""Update compression filters: float16 wire encoding and top-k sparsification."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from fedlink.common.dxo import DXO, DataKind, MetaValue
from fedlink.common.errors import InvalidArgument
from fedlink.common.tensors import TensorEncoding
from fedlink.runner.context import Context, Signal

__all__ = ["Float16Compression", "TopKSparsification"]

_FLOAT16_MAX = float(np.finfo(np.float16).max)


class Float16Compression:
    """Marks float variables for the float16 wire encoding, halving (or quartering) their size.

    What it does to the data: nothing in memory. It sets ``encodings[name] = FLOAT16`` for every
    float32/float64 variable of a ``WEIGHTS`` or ``WEIGHT_DIFF`` DXO, and the transport rounds the
    values to float16 when it encodes them (the receiver widens them back to the original dtype).
    Skipped, and left as they were: variables that are not float, already float16, already marked
    ``SPARSE`` (a sparse tensor's values keep their dtype), or holding a value outside float16's
    range (±65504), which the wire would refuse rather than send as infinity. Meta
    ``float16_variables`` counts the variables it marked. Other kinds pass through untouched.
    """

    def filter(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """Mark eligible variables ``FLOAT16`` (see the class doc)."""
        abort_signal.check()
        if dxo.kind not in (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF):
            return dxo
        encodings = dict(dxo.encodings)
        marked = 0
        for name, value in dxo.data.items():
            if (
                value.dtype.kind != "f"
                or value.dtype.itemsize <= 2
                or encodings.get(name, TensorEncoding.DENSE) == TensorEncoding.SPARSE
            ):
                continue
            if value.size and float(np.max(np.abs(value))) > _FLOAT16_MAX:
                continue
            encodings[name] = TensorEncoding.FLOAT16
            marked += 1
        meta: dict[str, MetaValue] = {**dxo.meta, "float16_variables": marked}
        return DXO(kind=dxo.kind, data=dict(dxo.data), meta=meta, encodings=encodings)


class TopKSparsification:
    """Keeps the k largest-magnitude entries of each variable of a ``WEIGHT_DIFF`` and zeroes the rest.

    What it does to the data: for every float variable with n elements it keeps exactly
    ``min(k, n)`` entries — or ``max(1, ceil(fraction * n))`` with ``fraction`` — those of largest
    absolute value (ties at the threshold broken deterministically), sets every other entry to 0 (a new
    array; the input is not changed) and sets ``encodings[name] = SPARSE``, so only the kept entries
    travel. Meta ``topk_kept`` maps each variable to its kept count and ``topk_fraction_kept`` is the
    overall kept fraction. There is no error feedback: the zeroed remainder is dropped, not carried to
    the next round. ``WEIGHTS`` are refused (zeroing model weights would destroy the model); other kinds
    pass through untouched.
    """

    def __init__(self, k: int | None = None, fraction: float | None = None) -> None:
        """Give exactly one of ``k`` (entries per variable) or ``fraction`` (of each variable, in (0, 1]).

        Raises:
            InvalidArgument: Both or neither given, or a value out of range.
        """
        if (k is None) == (fraction is None):
            raise InvalidArgument("TopKSparsification needs exactly one of k or fraction")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise InvalidArgument(f"k must be an integer >= 1, got {k!r}")
        if fraction is not None and (
            isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1
        ):
            raise InvalidArgument(f"fraction must be a number in (0, 1], got {fraction!r}")
        self.k = k
        self.fraction = None if fraction is None else float(fraction)

    def kept_count(self, size: int) -> int:
        """How many entries of a variable with ``size`` elements are kept."""
        if self.k is not None:
            return min(self.k, size)
        assert self.fraction is not None
        return min(size, max(1, math.ceil(self.fraction * size)))

    def filter(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """Sparsify every float variable (see the class doc)."""
        abort_signal.check()
        if dxo.kind == DataKind.WEIGHTS:
            raise InvalidArgument("TopKSparsification applies to a WEIGHT_DIFF, not to WEIGHTS")
        if dxo.kind != DataKind.WEIGHT_DIFF:
            return dxo
        data: dict[str, npt.NDArray[Any]] = {}
        encodings = dict(dxo.encodings)
        kept: dict[str, int] = {}
        for name, value in dxo.data.items():
            if value.dtype.kind != "f" or value.size == 0:
                data[name] = value
                continue
            count = self.kept_count(value.size)
            data[name] = _keep_top(value, count)
            encodings[name] = TensorEncoding.SPARSE
            kept[name] = count
        total = sum(v.size for name, v in dxo.data.items() if name in kept)
        meta: dict[str, MetaValue] = {
            **dxo.meta,
            "topk_kept": kept,
            "topk_fraction_kept": sum(kept.values()) / total if total else 1.0,
        }
        return DXO(kind=dxo.kind, data=data, meta=meta, encodings=encodings)


def _keep_top(value: npt.NDArray[Any], count: int) -> npt.NDArray[Any]:
    flat = value.reshape(-1)
    if count >= flat.size:
        return value.copy()
    # A partial sort: O(n) rather than a full argsort's O(n log n) on large variables.
    order = np.argpartition(np.abs(flat), flat.size - count)[flat.size - count :]
    result = np.zeros_like(flat)
    result[order] = flat[order]
    return result.reshape(value.shape)
