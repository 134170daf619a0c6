"""Streaming weighted averaging of model updates (FedAvg's aggregation step).

Memory grows with the model, not with the number of results: each update is folded into per-variable
float64 accumulators as it is read and then dropped. Callers feed updates in a canonical order (the
workflow sorts by device id) so the same inputs give the same bits whatever order they arrived in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from fedlink.common.errors import InvalidArgument


@dataclass(frozen=True, slots=True)
class VariableSpec:
    """Shape and dtype that every update of one model variable must have."""

    shape: tuple[int, ...]
    dtype: np.dtype[np.generic]


def model_spec(model: Mapping[str, NDArray[np.generic]]) -> dict[str, VariableSpec]:
    """Returns the spec (shape, dtype) of each variable of ``model``."""
    return {name: VariableSpec(tuple(a.shape), a.dtype) for name, a in model.items()}


def check_update(
    update: Mapping[str, NDArray[np.generic]], spec: Mapping[str, VariableSpec], *, allow_missing: bool = True
) -> None:
    """Checks that an update fits the model: known names, same shapes and dtypes, finite values.

    Raises:
        InvalidArgument: naming the first offending variable.
    """
    if not update:
        raise InvalidArgument("the update carries no variables")
    for name, array in update.items():
        expected = spec.get(name)
        if expected is None:
            raise InvalidArgument(f"variable {name!r} is not part of the model")
        if tuple(array.shape) != expected.shape:
            raise InvalidArgument(
                f"variable {name!r} has shape {tuple(array.shape)}, the model's is {expected.shape}"
            )
        if array.dtype != expected.dtype:
            raise InvalidArgument(
                f"variable {name!r} has dtype {array.dtype}, the model's is {expected.dtype}"
            )
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            raise InvalidArgument(f"variable {name!r} contains NaN or Inf")
    if not allow_missing:
        missing = sorted(set(spec) - set(update))
        if missing:
            raise InvalidArgument(f"the update lacks variables {missing}")


class WeightedAverage:
    """Accumulates ``sum(w_i * x_i) / sum(w_i)`` per variable over the updates that carry it.

    Accumulators are float64 whatever the model's dtype, so averaging many float32 updates loses
    nothing to intermediate rounding; :meth:`result` casts back to each variable's dtype.
    """

    def __init__(self, spec: Mapping[str, VariableSpec]) -> None:
        self._spec = dict(spec)
        self._sums: dict[str, NDArray[np.float64]] = {}
        self._weights: dict[str, float] = {}
        self._scratch: dict[tuple[int, ...], NDArray[np.float64]] = {}
        self.count = 0

    def add(self, update: Mapping[str, NDArray[np.generic]], weight: float, *, checked: bool = False) -> None:
        """Folds one update in with aggregation weight ``weight`` (> 0).

        ``checked`` says the update passed :func:`check_update` against this spec already (every
        recorded result did, when it was reported): it is not checked again.
        """
        if not (weight > 0 and np.isfinite(weight)):
            raise InvalidArgument(f"aggregation weight must be a positive finite number, got {weight}")
        if not checked:
            check_update(update, self._spec)
        for name, array in update.items():
            total = self._sums.get(name)
            if total is None:
                total = self._sums[name] = np.zeros(array.shape, dtype=np.float64)
                self._weights[name] = 0.0
            scratch = self._scratch.get(array.shape)
            if scratch is None:
                scratch = self._scratch[array.shape] = np.empty(array.shape, dtype=np.float64)
            # In place: one multiply into a reused buffer and one add, no temporaries per update.
            np.multiply(array, np.float64(weight), out=scratch)  # float64 math, not float32
            np.add(total, scratch, out=total)
            self._weights[name] += weight
        self.count += 1

    def covered(self) -> frozenset[str]:
        """Names of the variables at least one update carried."""
        return frozenset(self._sums)

    def result(self) -> dict[str, NDArray[np.float64]]:
        """The float64 average of each covered variable."""
        return {name: total / self._weights[name] for name, total in self._sums.items()}


def apply_average(
    global_model: Mapping[str, NDArray[np.generic]],
    average: WeightedAverage,
    *,
    is_diff: bool,
) -> dict[str, NDArray[np.generic]]:
    """Builds the next global model from the current one and an average of updates.

    With ``is_diff`` the average is a mean weight difference added to the current weights; otherwise it
    replaces them. Variables no update carried keep their current values.
    """
    out: dict[str, NDArray[np.generic]] = {}
    means = average.result()
    for name, current in global_model.items():
        mean = means.get(name)
        if mean is None:
            out[name] = current
        elif is_diff:
            out[name] = (current.astype(np.float64) + mean).astype(current.dtype)
        else:
            out[name] = mean.astype(current.dtype)
    return out
