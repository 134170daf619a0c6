"""Streaming weighted averaging of model updates (FedAvg's aggregation step), and the :class:`Aggregate`
every round rule produces.

Memory grows with the model, not with the number of results: each update is folded into per-variable
float64 accumulators as it is read and then dropped. Callers feed updates in a canonical order (the
workflow sorts by device id) so the same inputs give the same bits whatever order they arrived in.

A round's aggregate (the weighted mean here, a median or a trimmed mean in
:mod:`fedlink.server.workflows.robust`) is read a step of elements at a time, in float64
(:meth:`Aggregate.steps`), so that a server step (:mod:`fedlink.server.workflows.optimizers`) can make
the new model without float64 temporaries of the model's size.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from fedlink.common.errors import InvalidArgument
from fedlink.server.domain.updates import VariableSpec, check_update

#: Elements folded per step: the step's float64 scratch (512 KiB) stays in the CPU's cache, so an
#: update is read once and the accumulator read and written once, instead of every intermediate
#: going through memory (half the memory traffic of whole-array steps at 1,000,000 floats).
STEP = 1 << 16


class Aggregate(Protocol):
    """A round's aggregate update (a difference to the round's model), read a step at a time."""

    def covered(self) -> frozenset[str]:
        """Names of the variables the aggregate has (those at least one update carried)."""
        ...

    def steps(self, name: str) -> Iterator[tuple[int, NDArray[np.float64]]]:
        """A covered variable's aggregate, flattened, as ``(offset, float64 part)`` pairs in order.

        Each part may be a scratch buffer that the next step overwrites: use it before asking for more.
        """
        ...


def difference(value: NDArray[Any], base: NDArray[Any], out: NDArray[Any] | None = None) -> NDArray[Any]:
    """``value - base`` rounded to ``base``'s dtype: how a WEIGHTS update becomes a difference, so that
    WEIGHTS and WEIGHT_DIFF results mix.

    Computed in float64 and rounded, except for float32 and float64, whose own subtraction rounds the
    same (a float32 difference taken in float64 and rounded to float32 is the correctly rounded float32
    difference: 53 >= 2 * 24 + 2 bits); those are written into ``out`` when given.
    """
    result: NDArray[Any]
    if base.dtype in (np.float32, np.float64):
        result = np.subtract(value, base, out=out)
    else:
        result = np.subtract(value, base, dtype=np.float64).astype(base.dtype)
    return result


class WeightedAverage:
    """Accumulates ``sum(w_i * x_i) / sum(w_i)`` per variable over the updates that carry it.

    Accumulators are float64 whatever the model's dtype, so averaging many float32 updates loses
    nothing to intermediate rounding; :meth:`result` casts back to each variable's dtype.
    """

    def __init__(self, spec: Mapping[str, VariableSpec]) -> None:
        self._spec = dict(spec)
        self._sums: dict[str, NDArray[np.float64]] = {}
        self._weights: dict[str, float] = {}
        self._scratch = np.empty(0, dtype=np.float64)
        self._differences: dict[np.dtype[Any], NDArray[Any]] = {}
        self.count = 0

    def add(
        self,
        update: Mapping[str, NDArray[np.generic]],
        weight: float,
        *,
        checked: bool = False,
        minus: Mapping[str, NDArray[np.generic]] | None = None,
    ) -> None:
        """Folds one update in with aggregation weight ``weight`` (> 0).

        ``minus``: fold ``update - minus`` (each variable's :func:`difference`), a WEIGHTS update
        against the model it was trained from. ``checked`` says the update passed
        :func:`check_update` against this spec already (every recorded result did, when it was
        reported): it is not checked again.
        """
        if not (weight > 0 and np.isfinite(weight)):
            raise InvalidArgument(f"aggregation weight must be a positive finite number, got {weight}")
        if not checked:
            check_update(update, self._spec)
        w = np.float64(weight)
        for name, array in update.items():
            total = self._sums.get(name)
            if total is None:
                total = self._sums[name] = np.zeros(array.shape, dtype=np.float64)
                self._weights[name] = 0.0
            flat, sums = array.reshape(-1), total.reshape(-1)
            base = None if minus is None else minus[name].reshape(-1)
            for start in range(0, flat.size, STEP):
                part = flat[start : start + STEP]
                if base is not None:
                    part = difference(part, base[start : start + STEP], self._difference_buffer(part))
                scratch = self._scratch_buffer(part.size)
                np.multiply(part, w, out=scratch)  # float64 math, not float32
                np.add(sums[start : start + STEP], scratch, out=sums[start : start + STEP])
            self._weights[name] += weight
        self.count += 1

    def _scratch_buffer(self, size: int) -> NDArray[np.float64]:
        if self._scratch.size < size:
            self._scratch = np.empty(max(size, min(STEP, 1 << 20)), dtype=np.float64)
        return self._scratch[:size]

    def _difference_buffer(self, part: NDArray[Any]) -> NDArray[Any]:
        buffer = self._differences.get(part.dtype)
        if buffer is None or buffer.size < part.size:
            buffer = self._differences[part.dtype] = np.empty(max(part.size, STEP), dtype=part.dtype)
        return buffer[: part.size]

    def covered(self) -> frozenset[str]:
        """Names of the variables at least one update carried."""
        return frozenset(self._sums)

    def result(self) -> dict[str, NDArray[np.float64]]:
        """The float64 average of each covered variable."""
        return {name: total / self._weights[name] for name, total in self._sums.items()}

    def steps(self, name: str) -> Iterator[tuple[int, NDArray[np.float64]]]:
        """The float64 average of a covered variable, flattened, as ``(offset, part)`` a step at a time.

        The same values as :meth:`result`'s, without an array of the variable's size: each part is a
        scratch buffer, overwritten by the next step (use it before asking for the next).
        """
        sums = self._sums[name].reshape(-1)
        weight = self._weights[name]
        for start in range(0, sums.size, STEP):
            part = sums[start : start + STEP]
            yield start, np.divide(part, weight, out=self._scratch_buffer(part.size))


def apply_average(
    global_model: Mapping[str, NDArray[np.generic]],
    average: Aggregate,
    *,
    is_diff: bool,
) -> dict[str, NDArray[np.generic]]:
    """Builds the next global model from the current one and an aggregate of updates.

    With ``is_diff`` the aggregate is a weight difference added to the current weights; otherwise it
    replaces them. Variables no update carried keep their current values.
    """
    out: dict[str, NDArray[np.generic]] = {}
    covered = average.covered()
    for name, current in global_model.items():
        if name not in covered:
            out[name] = current
            continue
        # A step at a time, into the new array: (current + mean) in float64, rounded to the model's
        # dtype, as ``(current.astype(float64) + mean).astype(dtype)`` rounds it, without that
        # expression's three float64 temporaries of the model's size (a 1 GiB float32 model: 6 GiB).
        new = np.empty(current.shape, dtype=current.dtype)
        flat_new, flat_current = new.reshape(-1), current.reshape(-1)
        for start, mean in average.steps(name):
            end = start + mean.size
            if is_diff:
                np.add(mean, flat_current[start:end], out=mean, dtype=np.float64)
            flat_new[start:end] = mean
        out[name] = new
    return out
