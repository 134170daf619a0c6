"""What an update of a model must look like: each variable's shape and dtype, and finite values.

The device protocol checks every reported update against its task's model with :func:`check_update`
before acknowledging it; workflows aggregate only updates that passed.
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
