"""The device-side extension points: executors, filters, event handlers, data sources and datasets.

The names and signatures are those of NVIDIA FLARE's edge device spec, so code written for it ports by
changing imports. Executors, filters, handlers and data sources are :class:`typing.Protocol` classes:
subclass them (as in NVFlare) or just provide the method; the job config checks either with
``isinstance``. :class:`Dataset` is an abstract base class because it carries behaviour.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from fedlink.common.dxo import DXO
from fedlink.common.errors import InvalidArgument
from fedlink.runner.context import Context, Signal

__all__ = [
    "ArrayDataset",
    "Batch",
    "DataSource",
    "Dataset",
    "EventHandler",
    "Executor",
    "Filter",
]


@runtime_checkable
class Executor(Protocol):
    """Does the work of a task: turns the task's DXO into the result DXO."""

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """Run the task.

        Args:
            dxo: The task's input, after the in-filters.
            ctx: The task's context (task id and name, data source, handlers...).
            abort_signal: Check it (``abort_signal.check()``) in long loops.

        Returns:
            The result, before the out-filters.
        """
        ...


@runtime_checkable
class Filter(Protocol):
    """Transforms a DXO on its way into the executor (in-filter) or out of it (out-filter)."""

    def filter(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """Return the filtered DXO (a new one; do not change ``dxo`` in place)."""
        ...


@runtime_checkable
class EventHandler(Protocol):
    """Receives the events fired through :meth:`Context.fire_event`."""

    def handle_event(self, event_type: str, event_data: Any, ctx: Context) -> None:
        """React to one event (see :class:`~fedlink.runner.context.EventType` for the payloads)."""
        ...


@runtime_checkable
class DataSource(Protocol):
    """Gives an executor the device's local data, by dataset type ("train", "valid", "test")."""

    def get_dataset(self, dataset_type: str, ctx: Context) -> Dataset:
        """The dataset of this type.

        Raises:
            NotFound: This source has no dataset of that type (the built-in trainers then skip it).
        """
        ...


@dataclass(frozen=True, slots=True)
class Batch:
    """One mini-batch: inputs and labels with the same first dimension."""

    input: npt.NDArray[Any]
    label: npt.NDArray[Any]

    def get_input(self) -> npt.NDArray[Any]:
        """The inputs (NVFlare's accessor name)."""
        return self.input

    def get_label(self) -> npt.NDArray[Any]:
        """The labels (NVFlare's accessor name)."""
        return self.label


class Dataset(ABC):
    """A finite labelled dataset held as two numpy arrays.

    Subclasses implement :meth:`arrays`; the built-in numpy trainers use it directly (they shuffle
    indices themselves). :meth:`get_next_batch` and :meth:`reset` give NVFlare's sequential reader on
    top of it.
    """

    _cursor: int = 0

    @abstractmethod
    def arrays(self) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """The inputs ``x`` (samples first) and labels ``y`` (same length)."""

    def size(self) -> int:
        """The number of samples."""
        return len(self.arrays()[0])

    def get_next_batch(self, batch_size: int) -> Batch | None:
        """The next ``batch_size`` samples in order (fewer at the end), or None once exhausted."""
        x, y = self.arrays()
        if self._cursor >= len(x):
            return None
        start, self._cursor = self._cursor, self._cursor + batch_size
        return Batch(x[start : self._cursor], y[start : self._cursor])

    def reset(self) -> None:
        """Start :meth:`get_next_batch` over from the first sample."""
        self._cursor = 0


class ArrayDataset(Dataset):
    """A :class:`Dataset` over two in-memory arrays (no copy is made)."""

    def __init__(self, x: npt.ArrayLike, y: npt.ArrayLike, *, name: str = "dataset") -> None:
        """Wrap ``x`` and ``y``.

        Raises:
            InvalidArgument: ``x`` is a scalar or ``x`` and ``y`` differ in length (the message names
                the dataset).
        """
        x_arr, y_arr = np.asarray(x), np.asarray(y)
        if x_arr.ndim == 0 or y_arr.ndim == 0:
            raise InvalidArgument(f"{name}: x and y must be arrays with samples first, not scalars")
        if len(x_arr) != len(y_arr):
            raise InvalidArgument(f"{name}: x has {len(x_arr)} samples but y has {len(y_arr)}")
        self._x = x_arr
        self._y = y_arr

    def arrays(self) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        """The wrapped ``(x, y)``."""
        return self._x, self._y

    def __repr__(self) -> str:
        return f"ArrayDataset(x={self._x.shape}/{self._x.dtype}, y={self._y.shape}/{self._y.dtype})"
