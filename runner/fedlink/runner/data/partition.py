"""Splitting a dataset among devices: IID and label-skewed (Dirichlet) partitions."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from fedlink.common.errors import FailedPrecondition, InvalidArgument
from fedlink.runner.context import Context, ContextKey
from fedlink.runner.spec import ArrayDataset, Dataset, DataSource

__all__ = ["PartitionMethod", "PartitionedDataSource", "all_partitions", "partition_indices"]

PartitionMethod = Literal["iid", "dirichlet"]
_METHODS: Final = ("iid", "dirichlet")
# Redraws of the Dirichlet proportions before the empty-partition repair steps in.
_DIRICHLET_ATTEMPTS: Final = 10


def partition_indices(
    labels: npt.ArrayLike,
    num_partitions: int,
    partition_id: int,
    *,
    method: PartitionMethod = "iid",
    alpha: float = 0.5,
    seed: int = 0,
) -> npt.NDArray[np.int64]:
    """The sorted sample indices of partition ``partition_id`` of ``num_partitions``.

    Every device computes its own partition independently; because the split depends only on
    ``(labels, num_partitions, method, alpha, seed)``, the partitions of all devices are disjoint and
    together cover every sample exactly once. See :func:`all_partitions` for the methods.

    Raises:
        InvalidArgument: Bad ``partition_id`` or any argument :func:`all_partitions` refuses.
    """
    if isinstance(partition_id, bool) or not isinstance(partition_id, int):
        raise InvalidArgument(f"partition_id must be an integer, got {partition_id!r}")
    if not isinstance(num_partitions, int) or not 0 <= partition_id < num_partitions:
        raise InvalidArgument(f"partition_id must be in [0, {num_partitions}), got {partition_id}")
    return all_partitions(labels, num_partitions, method=method, alpha=alpha, seed=seed)[partition_id]


def all_partitions(
    labels: npt.ArrayLike,
    num_partitions: int,
    *,
    method: PartitionMethod = "iid",
    alpha: float = 0.5,
    seed: int = 0,
) -> list[npt.NDArray[np.int64]]:
    """Split the sample indices ``0..len(labels)-1`` into ``num_partitions`` sorted, disjoint parts.

    * ``"iid"``: a seeded shuffle cut into parts whose sizes differ by at most one.
    * ``"dirichlet"``: label skew. For every class, proportions ``p ~ Dirichlet(alpha, ..., alpha)``
      decide how that class's samples are shared among the partitions; small ``alpha`` (0.1) gives
      each partition few classes, large ``alpha`` (100) approaches IID. Labels must be 1-D and
      hashable by value (class indices, strings).

    Guarantee: every sample is in exactly one partition, and no partition is empty (both methods
    require ``len(labels) >= num_partitions``). For Dirichlet the proportions are redrawn up to 10
    times while some partition is empty; if one still is, it is given one sample taken from the
    largest partition. The result is a pure function of the arguments (seeded ``numpy`` generator).

    Raises:
        InvalidArgument: Fewer samples than partitions, an unknown method, ``alpha <= 0``,
            ``num_partitions < 1``, or non-1-D labels for Dirichlet.
    """
    y = np.asarray(labels)
    if y.ndim == 0:
        raise InvalidArgument("labels must be an array with one entry per sample")
    n = len(y)
    if isinstance(num_partitions, bool) or not isinstance(num_partitions, int) or num_partitions < 1:
        raise InvalidArgument(f"num_partitions must be an integer >= 1, got {num_partitions!r}")
    if n < num_partitions:
        raise InvalidArgument(f"cannot split {n} samples into {num_partitions} non-empty partitions")
    if method not in _METHODS:
        raise InvalidArgument(f"unknown partition method {method!r}; expected one of {list(_METHODS)}")
    rng = np.random.default_rng(seed)
    if method == "iid":
        parts = np.array_split(rng.permutation(n), num_partitions)
        return [np.sort(part).astype(np.int64) for part in parts]
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise InvalidArgument(f"alpha must be a number > 0, got {alpha!r}")
    if y.ndim != 1:
        raise InvalidArgument(f"dirichlet partitioning needs 1-D class labels, got shape {y.shape}")
    assignment = _dirichlet_assignment(y, num_partitions, float(alpha), rng)
    order = np.argsort(assignment, kind="stable")  # stable: indices stay sorted within a partition
    sizes = np.bincount(assignment, minlength=num_partitions)
    return [part.astype(np.int64) for part in np.split(order, np.cumsum(sizes)[:-1])]


def _dirichlet_assignment(
    labels: npt.NDArray[Any], num_partitions: int, alpha: float, rng: np.random.Generator
) -> npt.NDArray[np.int64]:
    _, classes = np.unique(labels, return_inverse=True)
    by_class = np.argsort(classes, kind="stable")
    class_sizes = np.bincount(classes)
    assignment = np.empty(len(labels), dtype=np.int64)
    for _attempt in range(_DIRICHLET_ATTEMPTS):
        start = 0
        for size in class_sizes:
            members = rng.permutation(by_class[start : start + size])
            start += size
            shares = rng.dirichlet(np.full(num_partitions, alpha))
            cuts = np.round(np.cumsum(shares) * size).astype(np.int64)
            cuts[-1] = size  # the shares sum to 1 only up to rounding
            counts = np.diff(np.concatenate(([0], cuts)))
            assignment[members] = np.repeat(np.arange(num_partitions), counts)
        sizes = np.bincount(assignment, minlength=num_partitions)
        if sizes.min() > 0:
            return assignment
    # Still an empty partition after the redraws (tiny alpha or few samples): fill each from the
    # largest partition, which has at least two samples whenever one is empty and n >= partitions.
    for empty in np.flatnonzero(sizes == 0):
        donor = int(np.argmax(sizes))
        moved = int(np.flatnonzero(assignment == donor)[-1])
        assignment[moved] = empty
        sizes[donor] -= 1
        sizes[empty] += 1
    return assignment


class PartitionedDataSource:
    """Exposes one partition of another data source: what one device of a simulation sees.

    ``get_dataset(t, ctx)`` for a type in ``dataset_types`` (default ``"train"`` and ``"valid"``)
    returns the samples of partition ``partition_id`` of ``num_partitions`` (see
    :func:`all_partitions`, split on the dataset's labels); other types (e.g. ``"test"``) are served
    whole. ``partition_id`` and ``num_partitions`` come from the args when given, else from the
    context's ``PARTITION_ID`` / ``NUM_PARTITIONS`` (which the simulation sets per virtual device).
    Splits and partitions are computed once and cached, so many devices may share one instance.
    """

    def __init__(
        self,
        source: DataSource,
        num_partitions: int | None = None,
        partition_id: int | None = None,
        method: PartitionMethod = "iid",
        alpha: float = 0.5,
        seed: int = 0,
        dataset_types: Sequence[str] = ("train", "valid"),
    ) -> None:
        """Wrap ``source``.

        Raises:
            InvalidArgument: ``source`` is not a DataSource or an unknown method.
        """
        if not isinstance(source, DataSource):
            raise InvalidArgument(f"PartitionedDataSource needs a DataSource, got {type(source).__name__}")
        if method not in _METHODS:
            raise InvalidArgument(f"unknown partition method {method!r}; expected one of {list(_METHODS)}")
        self.source = source
        self.num_partitions = num_partitions
        self.partition_id = partition_id
        self.method: PartitionMethod = method
        self.alpha = alpha
        self.seed = seed
        self.dataset_types = frozenset(dataset_types)
        self._lock = threading.Lock()
        self._splits: dict[tuple[str, int], list[npt.NDArray[np.int64]]] = {}
        self._parts: dict[tuple[str, int, int], Dataset] = {}

    def get_dataset(self, dataset_type: str, ctx: Context) -> Dataset:
        """The partition of this device (or the whole dataset for an unpartitioned type).

        Raises:
            NotFound: The wrapped source has no such dataset.
            FailedPrecondition: Neither the args nor the context give the partition.
            InvalidArgument: As :func:`partition_indices`.
        """
        dataset = self.source.get_dataset(dataset_type, ctx)
        if dataset_type not in self.dataset_types:
            return dataset
        count = self._setting("num_partitions", self.num_partitions, ContextKey.NUM_PARTITIONS, ctx)
        index = self._setting("partition_id", self.partition_id, ContextKey.PARTITION_ID, ctx)
        if not 0 <= index < count:
            raise InvalidArgument(f"partition_id must be in [0, {count}), got {index}")
        with self._lock:
            part = self._parts.get((dataset_type, count, index))
            if part is None:
                x, y = dataset.arrays()
                split = self._splits.get((dataset_type, count))
                if split is None:
                    split = all_partitions(y, count, method=self.method, alpha=self.alpha, seed=self.seed)
                    self._splits[(dataset_type, count)] = split
                indices = split[index]
                part = ArrayDataset(x[indices], y[indices], name=f"{dataset_type}[{index}/{count}]")
                self._parts[(dataset_type, count, index)] = part
            return part

    @staticmethod
    def _setting(name: str, given: int | None, key: ContextKey, ctx: Context) -> int:
        value = given if given is not None else ctx.get(key)
        if value is None:
            raise FailedPrecondition(
                f"PartitionedDataSource needs {name}: give it as an arg or set the context's {key.value!r}"
            )
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgument(f"{name} must be an integer, got {value!r}")
        return value
