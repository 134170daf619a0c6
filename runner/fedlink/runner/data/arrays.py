"""A data source over in-memory numpy arrays."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy.typing as npt

from fedlink.common.errors import InvalidArgument, NotFound
from fedlink.runner.context import Context
from fedlink.runner.spec import ArrayDataset, Dataset

__all__ = ["ArrayDataSource"]


class ArrayDataSource:
    """Serves ``(x, y)`` array pairs by dataset type (``"train"``, ``"valid"``, ``"test"``, or any name).

    Example: ``ArrayDataSource({"train": (x_train, y_train), "test": (x_test, y_test)})``. In a job
    config the arrays may be given as nested JSON lists.
    """

    def __init__(self, datasets: Mapping[str, Sequence[npt.ArrayLike]]) -> None:
        """Wrap the arrays (no copy is made of numpy arrays).

        Raises:
            InvalidArgument: An entry is not an ``(x, y)`` pair, or x and y differ in length.
        """
        if not isinstance(datasets, Mapping) or not datasets:
            raise InvalidArgument("ArrayDataSource needs a non-empty mapping of dataset type -> (x, y)")
        self._datasets: dict[str, Dataset] = {}
        for dataset_type, pair in datasets.items():
            if isinstance(pair, str | bytes) or len(pair) != 2:
                raise InvalidArgument(f"ArrayDataSource[{dataset_type!r}] must be an (x, y) pair")
            self._datasets[dataset_type] = ArrayDataset(pair[0], pair[1], name=dataset_type)

    @property
    def dataset_types(self) -> tuple[str, ...]:
        """The dataset types this source serves."""
        return tuple(self._datasets)

    def get_dataset(self, dataset_type: str, ctx: Context) -> Dataset:
        """The dataset of this type.

        Raises:
            NotFound: No dataset of that type.
        """
        try:
            return self._datasets[dataset_type]
        except KeyError:
            raise NotFound(f"no {dataset_type!r} dataset; this source has {list(self._datasets)}") from None

    def __repr__(self) -> str:
        inner: dict[str, Any] = {name: ds.size() for name, ds in self._datasets.items()}
        return f"ArrayDataSource(sizes={inner})"
