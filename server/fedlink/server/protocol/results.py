"""What a result must look like before it is acknowledged.

A result is checked against the task that asked for it: a ``train`` result is a WEIGHTS or WEIGHT_DIFF
DXO whose variables are a subset of the task's model with the same shapes and dtypes, all finite, and a
positive aggregation weight; an ``evaluate`` result is a METRICS DXO with finite numeric metrics. A
result that fails gets INVALID_ARGUMENT and is not stored, so it can never reach an aggregate.

What a result declares (its kind, each tensor's name, dtype and shape) is checked before any of it is
decoded: a few bytes declaring a huge tensor must not make the coordinator build it. An update then
decodes to at most the size of the model it updates, and an evaluation result to at most
:data:`MAX_METRICS_TENSORS` tensors of :data:`METRICS_BYTES` together (or the model's size if larger).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Final, Protocol

from fedlink.common.dxo import DXO, DataKind, weight_of
from fedlink.common.dxo_outline import DeclaredDxo, TensorOutline
from fedlink.common.errors import InvalidArgument
from fedlink.server.coordination.model_outlines import ModelOutlines
from fedlink.server.domain import EVALUATE_TASK, Task
from fedlink.server.domain.updates import VariableSpec, check_layout, check_update
from fedlink.server.store import BlobStore

#: Most tensors an evaluation result may carry (its metrics: the built-in executors send one or two).
MAX_METRICS_TENSORS: Final[int] = 1_000
#: Bytes an evaluation result's tensors may decode to, or the model's size if that is larger.
METRICS_BYTES: Final[int] = 1024 * 1024
_UPDATE_KINDS: Final = (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF)


class ResultValidator(Protocol):
    """Checks a reported DXO against the task it answers."""

    async def check_declared(self, task: Task, result: DeclaredDxo) -> None:
        """Raises InvalidArgument if what ``result`` declares cannot answer ``task`` (before decoding)."""
        ...

    async def validate(self, task: Task, result: DXO) -> None:
        """Raises InvalidArgument if ``result`` is not an acceptable answer to ``task``."""
        ...


class ModelTaskValidator:
    """Validates ``train`` and ``evaluate`` results against the model each task carried."""

    def __init__(self, blobs: BlobStore, *, outlines: ModelOutlines | None = None) -> None:
        # The task's model is only outlined (streamed, tensor data skipped), never loaded.
        self._outlines = outlines or ModelOutlines(blobs)

    async def check_declared(self, task: Task, result: DeclaredDxo) -> None:
        """Raises InvalidArgument naming what is wrong with what ``result`` declares, reading no more of
        it than the task's model has variables (plus one)."""
        if task.name == EVALUATE_TASK:
            _check_metrics_kind(result.kind)
            await self._check_metrics_size(task, result)
            return
        _check_update_kind(task, result.kind)
        if task.payload_sha256 is not None:
            check_layout(_Layout(result.tensors), await self._outlines.spec(task.payload_sha256))

    async def validate(self, task: Task, result: DXO) -> None:
        """Raises InvalidArgument naming what is wrong with ``result``."""
        result.validate()
        if task.name == EVALUATE_TASK:
            check_metrics(result)
            return
        _check_update_kind(task, result.kind)
        if task.payload_sha256 is not None:
            check_update(result.data, await self._outlines.spec(task.payload_sha256))
        weight_of(result)

    async def _check_metrics_size(self, task: Task, result: DeclaredDxo) -> None:
        count = len(result.tensors)
        if count > MAX_METRICS_TENSORS:
            raise InvalidArgument(
                f"the evaluation result carries {count} tensors, more than the limit of {MAX_METRICS_TENSORS}"
            )
        limit = METRICS_BYTES
        if task.payload_sha256 is not None:
            spec = await self._outlines.spec(task.payload_sha256)
            limit = max(limit, sum(math.prod(v.shape) * v.dtype.itemsize for v in spec.values()))
        size = result.decoded_nbytes()
        if size > limit:
            raise InvalidArgument(
                f"the evaluation result's tensors would decode to {size} bytes, more than the limit of "
                f"{limit} (the larger of {METRICS_BYTES} and the model's size)"
            )


def check_metrics(result: DXO) -> None:
    """An evaluation result: METRICS with finite numbers (non-numeric entries are allowed as labels)."""
    _check_metrics_kind(result.kind)
    for key, value in result.meta.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidArgument(f"metric {key!r} is {value}")


def _check_metrics_kind(kind: DataKind) -> None:
    if kind is not DataKind.METRICS:
        raise InvalidArgument(f"an evaluation result must be METRICS, not {kind}")


def _check_update_kind(task: Task, kind: DataKind) -> None:
    if kind not in _UPDATE_KINDS:
        raise InvalidArgument(f"a {task.name!r} result must be WEIGHTS or WEIGHT_DIFF, not {kind}")


class _Layout(Mapping[str, VariableSpec]):
    """The variables a result declares, as the model's spec describes variables (each read on lookup)."""

    def __init__(self, tensors: Mapping[str, TensorOutline]) -> None:
        self._tensors = tensors

    def __getitem__(self, name: str) -> VariableSpec:
        tensor = self._tensors[name]
        return VariableSpec(tensor.shape, tensor.decoded_dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)
