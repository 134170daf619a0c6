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

from fedlink.common.dxo import DXO, MAX_TENSORS, DataKind, weight_of
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


class ResultChecks(Protocol):
    """The checks of results answering one task, with what they need of its model at hand.

    Synchronous and safe to call from a worker thread: the device protocol runs them off the event loop
    for large or many-tensor results (:mod:`fedlink.server.protocol.decoding`).
    """

    def tensor_bound(self) -> tuple[int, str]:
        """How many tensors an answer may carry at most, and why (for the refusal's message)."""
        ...

    def check_declared(self, result: DeclaredDxo) -> None:
        """Raises InvalidArgument if what ``result`` declares cannot answer the task (before decoding)."""
        ...

    def validate(self, result: DXO) -> None:
        """Raises InvalidArgument if ``result`` is not an acceptable answer to the task."""
        ...


class ResultValidator(Protocol):
    """Checks a reported DXO against the task it answers."""

    async def checks(self, task: Task) -> ResultChecks:
        """The checks of results answering ``task`` (reading what they need of its model first)."""
        ...


class ModelTaskValidator:
    """Validates ``train`` and ``evaluate`` results against the model each task carried."""

    def __init__(self, blobs: BlobStore, *, outlines: ModelOutlines | None = None) -> None:
        # The task's model is only outlined (streamed, tensor data skipped), never loaded.
        self._outlines = outlines or ModelOutlines(blobs)

    async def checks(self, task: Task) -> ResultChecks:
        """The checks of ``task``'s results, against the spec of the model it carried (if any)."""
        spec = None if task.payload_sha256 is None else await self._outlines.spec(task.payload_sha256)
        return _TaskChecks(task, spec)

    async def check_declared(self, task: Task, result: DeclaredDxo) -> None:
        """:meth:`ResultChecks.check_declared` of ``task``'s checks."""
        (await self.checks(task)).check_declared(result)

    async def validate(self, task: Task, result: DXO) -> None:
        """:meth:`ResultChecks.validate` of ``task``'s checks."""
        (await self.checks(task)).validate(result)


class _TaskChecks:
    """:class:`ResultChecks` of one task, given its model's spec (None: the task carried no model)."""

    def __init__(self, task: Task, spec: Mapping[str, VariableSpec] | None) -> None:
        self._task = task
        self._spec = spec

    def tensor_bound(self) -> tuple[int, str]:
        """The model's variables for an update, :data:`MAX_METRICS_TENSORS` for an evaluation."""
        if self._task.name == EVALUATE_TASK:
            return MAX_METRICS_TENSORS, f"an evaluation result carries at most {MAX_METRICS_TENSORS}"
        if self._spec is not None:
            return len(self._spec), f"the model has {len(self._spec)} variables"
        return MAX_TENSORS, f"the limit is {MAX_TENSORS} tensors in one DXO"

    def check_declared(self, result: DeclaredDxo) -> None:
        """Raises InvalidArgument naming what is wrong with what ``result`` declares, reading no more of
        it than the task's model has variables (plus one)."""
        if self._task.name == EVALUATE_TASK:
            _check_metrics_kind(result.kind)
            self._check_metrics_size(result)
            return
        _check_update_kind(self._task, result.kind)
        if self._spec is not None:
            check_layout(_Layout(result.tensors), self._spec)

    def validate(self, result: DXO) -> None:
        """Raises InvalidArgument naming what is wrong with ``result``."""
        result.validate()
        if self._task.name == EVALUATE_TASK:
            check_metrics(result)
            return
        _check_update_kind(self._task, result.kind)
        if self._spec is not None:
            check_update(result.data, self._spec)
        weight_of(result)

    def _check_metrics_size(self, result: DeclaredDxo) -> None:
        count = len(result.tensors)
        if count > MAX_METRICS_TENSORS:
            raise InvalidArgument(
                f"the evaluation result carries {count} tensors, more than the limit of {MAX_METRICS_TENSORS}"
            )
        limit = METRICS_BYTES
        if self._spec is not None:
            limit = max(limit, sum(math.prod(v.shape) * v.dtype.itemsize for v in self._spec.values()))
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
