"""What an update of a model must look like: each variable's shape and dtype, and finite values.

The device protocol checks every reported update against its task's model twice: with
:func:`check_layout` on what the update declares (names, shapes, dtypes) before any of it is decoded, so
that a hostile device cannot make the coordinator build arrays the model does not have, then with
:func:`check_update` on the decoded arrays before acknowledging it; workflows aggregate only updates
that passed.
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


def check_layout(layout: Mapping[str, VariableSpec], spec: Mapping[str, VariableSpec]) -> None:
    """Checks the variables an update declares against the model: known names, same shapes and dtypes.

    It reads no more of ``layout`` than the model has variables (plus one), however many it declares.

    Raises:
        InvalidArgument: naming the first offending variable.
    """
    if not layout:
        raise InvalidArgument("the update carries no variables")
    extra = len(layout) > len(spec)
    for name, declared in layout.items():
        # Of more names than the model has, one is not the model's: the loop ends there at the latest.
        _check_variable(name, declared.shape, declared.dtype, spec, of=len(layout) if extra else None)


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
        _check_variable(name, tuple(array.shape), array.dtype, spec)
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            raise InvalidArgument(f"variable {name!r} contains NaN or Inf")
    if not allow_missing:
        missing = sorted(set(spec) - set(update))
        if missing:
            raise InvalidArgument(f"the update lacks variables {missing}")


def _check_variable(
    name: str,
    shape: tuple[int, ...],
    dtype: np.dtype[np.generic],
    spec: Mapping[str, VariableSpec],
    *,
    of: int | None = None,
) -> None:
    expected = spec.get(name)
    if expected is None:
        counts = f" (the update carries {of} variables, the model {len(spec)})" if of is not None else ""
        raise InvalidArgument(f"variable {name!r} is not part of the model{counts}")
    if shape != expected.shape:
        raise InvalidArgument(f"variable {name!r} has shape {shape}, the model's is {expected.shape}")
    if dtype != expected.dtype:
        raise InvalidArgument(f"variable {name!r} has dtype {dtype}, the model's is {expected.dtype}")
