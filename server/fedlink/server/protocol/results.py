"""What a result must look like before it is acknowledged.

A result is checked against the task that asked for it: a ``train`` result is a WEIGHTS or WEIGHT_DIFF
DXO whose variables are a subset of the task's model with the same shapes and dtypes, all finite, and a
positive aggregation weight; an ``evaluate`` result is a METRICS DXO with finite numeric metrics. A
result that fails gets INVALID_ARGUMENT and is not stored, so it can never reach an aggregate.
"""

from __future__ import annotations

import math
from typing import Protocol

from fedlink.common.dxo import DXO, DataKind, weight_of
from fedlink.common.errors import InvalidArgument
from fedlink.server.coordination.model_outlines import ModelOutlines
from fedlink.server.domain import EVALUATE_TASK, Task
from fedlink.server.domain.updates import check_update
from fedlink.server.store import BlobStore


class ResultValidator(Protocol):
    """Checks a reported DXO against the task it answers."""

    async def validate(self, task: Task, result: DXO) -> None:
        """Raises InvalidArgument if ``result`` is not an acceptable answer to ``task``."""
        ...


class ModelTaskValidator:
    """Validates ``train`` and ``evaluate`` results against the model each task carried."""

    def __init__(self, blobs: BlobStore, *, outlines: ModelOutlines | None = None) -> None:
        # The task's model is only outlined (streamed, tensor data skipped), never loaded.
        self._outlines = outlines or ModelOutlines(blobs)

    async def validate(self, task: Task, result: DXO) -> None:
        """Raises InvalidArgument naming what is wrong with ``result``."""
        result.validate()
        if task.name == EVALUATE_TASK:
            check_metrics(result)
            return
        if result.kind not in (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF):
            raise InvalidArgument(f"a {task.name!r} result must be WEIGHTS or WEIGHT_DIFF, not {result.kind}")
        if task.payload_sha256 is not None:
            check_update(result.data, await self._outlines.spec(task.payload_sha256))
        weight_of(result)


def check_metrics(result: DXO) -> None:
    """An evaluation result: METRICS with finite numbers (non-numeric entries are allowed as labels)."""
    if result.kind is not DataKind.METRICS:
        raise InvalidArgument(f"an evaluation result must be METRICS, not {result.kind}")
    for key, value in result.meta.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidArgument(f"metric {key!r} is {value}")
