"""A device's data file and how it is split among the devices: one description, used everywhere.

``fedlink runner --data FILE --partition-id I --num-partitions N --partition dirichlet ...`` and
``fedlink simulate JOB --data FILE`` (or the job file's ``[simulation]`` section) both build their data
source here, so that device ``I`` of ``N`` trains on the same samples whichever way the job runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final, get_args

from fedlink.common.errors import InvalidArgument
from fedlink.runner.data.files import NpzDataSource
from fedlink.runner.data.partition import PartitionedDataSource, PartitionMethod

__all__ = ["DeviceData"]

_METHODS: Final = get_args(PartitionMethod)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceData:
    """An ``.npz`` file (``x_train``/``y_train``, and optionally ``x_valid``/``y_valid``, ``x_test``...)
    and how its ``train`` and ``valid`` datasets are split among devices (``test`` is never split)."""

    path: Path
    """The ``.npz`` file."""
    partition: PartitionMethod = "iid"
    """``iid`` or ``dirichlet`` (label skew)."""
    alpha: float = 0.5
    """Dirichlet concentration (smaller: more skew)."""
    seed: int = 0
    """Seed of the split: the same on every device of a federation."""

    def __post_init__(self) -> None:
        if self.partition not in _METHODS:
            raise InvalidArgument(f"partition must be iid or dirichlet, not {self.partition!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not self.alpha > 0:
            raise InvalidArgument(f"partition_alpha must be a number > 0, not {self.alpha!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InvalidArgument(f"partition_seed must be an integer, not {self.seed!r}")

    def whole(self) -> NpzDataSource:
        """The file, unsplit (a device that is given only its own data).

        Raises:
            NotFound: The file does not exist (the message names it).
            InvalidArgument: It is not a readable ``.npz`` of ``x_``/``y_`` pairs.
        """
        return NpzDataSource(os.fspath(self.path))

    def partitioned(
        self, partition_id: int | None = None, num_partitions: int | None = None
    ) -> PartitionedDataSource:
        """Partition ``partition_id`` of ``num_partitions`` of the file; with neither, the partition each
        task's context names (a simulation's device ``i`` of ``N``), the split computed once.

        Raises:
            NotFound: The file does not exist (the message names it).
            InvalidArgument: As :meth:`whole`, or only one of ``partition_id`` and ``num_partitions``.
        """
        if (partition_id is None) != (num_partitions is None):
            raise InvalidArgument("partition_id and num_partitions go together")
        return PartitionedDataSource(
            self.whole(),
            num_partitions=num_partitions,
            partition_id=partition_id,
            method=self.partition,
            alpha=self.alpha,
            seed=self.seed,
        )
