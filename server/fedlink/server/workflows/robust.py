"""Robust aggregation: the coordinate-wise median, the trimmed mean, Krum and Multi-Krum.

These rules look at all of a round's updates together, so they cannot stream as FedAvg's mean does: a
round holds its updates in memory. The bound is explicit: a round aggregates at most
``devices_per_round`` results (the first that many accepted ones in the canonical order: a retried
round's extra results are recorded, not aggregated), so it holds at most ``devices_per_round`` updates
of the model's size, plus the round's model and the new one; a job whose ``devices_per_round`` times the
model's size exceeds the coordinator's ``max_buffered_round_bytes`` is refused at submission.

Updates are held as they are reported (an :class:`~fedlink.server.coordination.progress.UpdateSink`:
no payload is read back at the close unless another replica or an earlier process recorded it), then
at the close copied, as differences to the round's model in the model's dtype, into one array per
variable (``results × elements``) and the held copies dropped: the close's peak is that array plus a
model and a step's float64 scratch. The aggregate is computed a block of coordinates at a time in
float64 (:meth:`RobustAggregate.steps`).

Results, as Flower 1.42 computes them (its FedMedian, FedTrimmedAvg, Krum and MultiKrum):

- median and trimmed mean are unweighted, per variable over the results that carry it, and do not
  depend on the order of the results at all: the same updates give the same bits;
- Krum scores each result by the sum of its squared distances (over every variable; a variable a result
  leaves out counts as unchanged) to its ``n - f - 2`` nearest others (at least 1), and averages the
  ``m`` best, weighted as FedAvg weighs. Ties are broken by the canonical order, and the chosen are
  averaged in that order, so the same updates give the same bits there too.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from fedlink.common.dxo import DXO, DataKind, weight_of
from fedlink.common.errors import FailedPrecondition, InvalidArgument
from fedlink.server.domain import Result, Task
from fedlink.server.workflows.aggregation import difference
from fedlink.server.workflows.fedavg import FedAvgParams, RoundRule, RoundUpdates
from fedlink.server.workflows.folding import LazyModel, MetricAverage, OrderKey

#: Float64 elements of one block of coordinates (rows × columns): 8 MiB of scratch.
_BLOCK_ELEMENTS = 1 << 20


class RobustRule(Protocol):
    """Turns a round's updates (rows of differences) into its aggregate, a block at a time."""

    def prepare(self, stacks: Mapping[str, NDArray[Any]], weights: NDArray[np.float64]) -> None:
        """Sees every variable's rows before any block is asked for (Krum chooses here)."""
        ...

    def block(self, name: str, rows: NDArray[np.float64]) -> NDArray[np.float64]:
        """The aggregate of one block of a variable's coordinates (``rows``: results × columns)."""
        ...


class Median:
    """The coordinate-wise median (an even count averages its two middle values, in float64)."""

    def prepare(self, stacks: Mapping[str, NDArray[Any]], weights: NDArray[np.float64]) -> None:
        """Nothing to prepare."""

    def block(self, name: str, rows: NDArray[np.float64]) -> NDArray[np.float64]:
        """The median of each column."""
        result: NDArray[np.float64] = np.median(rows, axis=0, overwrite_input=True)
        return result


class TrimmedMean:
    """The coordinate-wise mean after cutting ``floor(beta * n)`` values from each end."""

    def __init__(self, beta: float) -> None:
        self._beta = beta

    def prepare(self, stacks: Mapping[str, NDArray[Any]], weights: NDArray[np.float64]) -> None:
        """Nothing to prepare."""

    def block(self, name: str, rows: NDArray[np.float64]) -> NDArray[np.float64]:
        """The trimmed mean of each column (sorted, so the result does not depend on the row order)."""
        n = rows.shape[0]
        cut = int(self._beta * n)
        rows.sort(axis=0)
        result: NDArray[np.float64] = rows[cut : n - cut].mean(axis=0)
        return result


class Krum:
    """Krum (``num_to_select`` 1) and Multi-Krum: the weighted mean of the best-scored results."""

    def __init__(self, *, num_malicious: int, num_to_select: int) -> None:
        self._f = num_malicious
        self._m = num_to_select
        #: The chosen rows (ascending: the canonical order) and their weights, once prepared.
        self.chosen: NDArray[np.intp] = np.zeros(0, dtype=np.intp)
        self._weights: NDArray[np.float64] = np.zeros(0)

    def prepare(self, stacks: Mapping[str, NDArray[Any]], weights: NDArray[np.float64]) -> None:
        """Scores every result and chooses the best ``num_to_select``."""
        n = len(weights)
        gram = np.zeros((n, n), dtype=np.float64)
        for stack in stacks.values():
            flat = stack.reshape(n, -1)
            width = max(1, _BLOCK_ELEMENTS // max(1, n))
            for start in range(0, flat.shape[1], width):
                block = flat[:, start : start + width].astype(np.float64)
                gram += block @ block.T
        norms = np.diag(gram)
        distances = norms[:, None] + norms[None, :] - 2.0 * gram
        closest = max(1, n - self._f - 2)
        scores = np.empty(n, dtype=np.float64)
        for i in range(n):
            others = np.delete(distances[i], i)
            scores[i] = np.sort(others)[:closest].sum() if n > 1 else 0.0
        best = np.argsort(scores, kind="stable")[: self._m]
        self.chosen = np.sort(best)
        self._weights = weights[self.chosen]

    def block(self, name: str, rows: NDArray[np.float64]) -> NDArray[np.float64]:
        """The weighted mean of the chosen rows of each column."""
        chosen = rows[self.chosen]
        result: NDArray[np.float64] = np.tensordot(self._weights, chosen, axes=1) / self._weights.sum()
        return result


class RobustAggregate:
    """A round's robust aggregate over its stacked updates, read a block of coordinates at a time."""

    def __init__(self, stacks: Mapping[str, NDArray[Any]], rule: RobustRule) -> None:
        self._stacks = stacks
        self._rule = rule

    def covered(self) -> frozenset[str]:
        """The variables at least one result carried."""
        return frozenset(self._stacks)

    def steps(self, name: str) -> Iterator[tuple[int, NDArray[np.float64]]]:
        """The aggregate of a variable, flattened, a block of columns at a time."""
        stack = self._stacks[name]
        flat = stack.reshape(stack.shape[0], -1)
        width = max(1, _BLOCK_ELEMENTS // max(1, flat.shape[0]))
        for start in range(0, flat.shape[1], width):
            yield start, self._rule.block(name, flat[:, start : start + width].astype(np.float64))


@dataclass(slots=True)
class _Held:
    request_id: str
    update: DXO
    confirmed: bool = False


class BufferedRound:
    """One round's updates, held whole for a robust rule (see the module docstring)."""

    def __init__(self, model: LazyModel, *, rule: RobustRule, capacity: int, missing_as_zero: bool) -> None:
        self.model = model
        self.metrics = MetricAverage()
        self._rule = rule
        self._capacity = capacity
        #: Krum measures whole updates: a variable a result leaves out is a row of zeros there.
        self._missing_as_zero = missing_as_zero
        self._keys: dict[str, OrderKey] = {}
        self._held: dict[str, _Held] = {}
        self._closing = False
        #: What the close took, in canonical order: (device, weight).
        self._taken: list[tuple[str, float]] = []
        self._aggregate: RobustAggregate | None = None

    # ---- the UpdateSink ----
    def offer(self, task_id: str, request_id: str, update: DXO) -> bool:
        """Holds a validated update of a task this round handed out, while there is room."""
        if self._closing or task_id not in self._keys or task_id in self._held:
            return False
        if len(self._held) >= self._capacity:
            return False
        self._held[task_id] = _Held(request_id, update)
        return True

    def settle(self, task_id: str, request_id: str, *, accepted: bool) -> None:
        """Keeps an accepted update; drops one the store did not accept."""
        held = self._held.get(task_id)
        if held is None or held.request_id != request_id:
            return
        if accepted:
            held.confirmed = True
        else:
            del self._held[task_id]

    async def absorbed(self, task_id: str, *, patience: float) -> None:
        """At once: a held update waits for the close, and the holding is bounded by ``capacity``."""

    # ---- what the workflow tells it ----
    def expect(self, tasks: Sequence[Task], devices: Sequence[str]) -> None:
        """Adds train tasks handed out."""
        for task, device in zip(tasks, devices, strict=True):
            self._keys[task.task_id] = (task.created_at, device)

    @property
    def count(self) -> int:
        """How many results the aggregate holds."""
        return len(self._taken)

    def devices(self) -> list[str]:
        """The devices whose results the aggregate holds, in canonical order."""
        return [device for device, _ in self._taken]

    def aggregate(self) -> RobustAggregate:
        """The round's aggregate (after a finish)."""
        if self._aggregate is None:
            raise FailedPrecondition("the round's robust aggregate is asked for before the round closed")
        return self._aggregate

    # ---- the close ----
    async def finish_if_all_folded(self, succeeded: int) -> bool:
        """Ends the closed round from what it holds if that is every accepted result."""
        self._closing = True
        confirmed = [task_id for task_id, held in self._held.items() if held.confirmed]
        if len(confirmed) != succeeded:
            return False
        ordered = sorted(confirmed, key=self._keys.__getitem__)
        await self._close([(self._keys[t][1], self._held.pop(t).update) for t in ordered])
        return True

    async def finish(
        self, results: Sequence[Result], read_each: Callable[[Sequence[str]], AsyncIterator[bytes]]
    ) -> None:
        """Takes the first ``capacity`` of the closed round's accepted ``results`` (canonical order),
        from what it holds or else from the store.

        Raises:
            FailedPrecondition: a result's payload was neither kept by the store nor held here.
        """
        self._closing = True
        chosen = list(results[: self._capacity])
        wanted = {r.task_id for r in chosen}
        for task_id in [t for t in self._held if t not in wanted]:
            del self._held[task_id]  # room first for what the store has to give
        from_memory: dict[str, DXO] = {}
        for result in chosen:
            held = self._held.pop(result.task_id, None)
            if held is not None and held.request_id == result.request_id:
                from_memory[result.task_id] = held.update
            elif result.payload_sha256 is None:
                raise FailedPrecondition(
                    f"the payload of result {result.result_id} was not kept and is not held for the round"
                )
        stored = read_each(
            [r.payload_sha256 for r in chosen if r.task_id not in from_memory and r.payload_sha256]
        )
        taken: list[tuple[str, DXO]] = []
        for result in chosen:
            update = from_memory.pop(result.task_id, None)
            if update is None:
                update = DXO.from_bytes(await anext(stored))
            taken.append((result.device_id, update))
        await self._close(taken)

    async def _close(self, taken: list[tuple[str, DXO]]) -> None:
        """Stacks the taken updates as differences to the model (dropping each once copied), then lets
        the rule prepare."""
        spec = self.model.spec
        base = await self.model.arrays() if any(u.kind is DataKind.WEIGHTS for _, u in taken) else None
        carried: dict[str, list[int]] = {}
        for i, (_, update) in enumerate(taken):
            for name in update.data:
                carried.setdefault(name, []).append(i)
        n = len(taken)
        stacks: dict[str, NDArray[Any]] = {}
        rows_of: dict[str, dict[int, int]] = {}
        for name, which in carried.items():
            count = n if self._missing_as_zero else len(which)
            variable = spec[name]
            stacks[name] = np.zeros((count, *variable.shape), dtype=variable.dtype)
            rows_of[name] = {i: (i if self._missing_as_zero else row) for row, i in enumerate(which)}
        weights = np.empty(n, dtype=np.float64)
        for i in range(n):
            device, update = taken[i]
            taken[i] = (device, _DROPPED)  # the stack holds its values from here: let the update go
            weights[i] = weight = weight_of(update)
            self.metrics.add(update.meta, weight)
            for name, array in update.data.items():
                row = stacks[name][rows_of[name][i]]
                row[...] = (
                    array if update.kind is not DataKind.WEIGHTS else difference(array, _base(base)[name])
                )
            self._taken.append((device, weight))
            del update
        self._rule.prepare(stacks, weights)
        self._aggregate = RobustAggregate(stacks, self._rule)


def _base(model: Mapping[str, NDArray[Any]] | None) -> Mapping[str, NDArray[Any]]:
    assert model is not None, "a WEIGHTS update is taken against the round's model, loaded for it"
    return model


#: Stands in for an update once its values are in the round's stacks.
_DROPPED = DXO(kind=DataKind.WEIGHT_DIFF, data={})


# ---- parameters -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RobustParams(FedAvgParams):
    """The rounds of a robust rule: FedAvg's, with ``devices_per_round`` required (it bounds memory)."""

    def __post_init__(self) -> None:
        FedAvgParams.__post_init__(self)
        if self.devices_per_round < 1:
            raise InvalidArgument(
                "devices_per_round must be set: a robust rule holds a round's updates in memory, "
                "devices_per_round of them"
            )

    def check_memory(self, *, model_bytes: int, max_buffered_round_bytes: int) -> None:
        """Refuses a round that would hold more than ``max_buffered_round_bytes`` of updates."""
        held = self.devices_per_round * model_bytes
        if held > max_buffered_round_bytes:
            raise InvalidArgument(
                f"a round would hold {self.devices_per_round} updates of {model_bytes} bytes "
                f"({held} bytes), over the coordinator's max_buffered_round_bytes of "
                f"{max_buffered_round_bytes}: lower devices_per_round, or raise max_buffered_round_bytes"
            )

    def round_rule(self) -> RoundRule:
        """Opens each round's holder of updates."""
        rule, missing_as_zero = self._rule()

        def open_round(model: LazyModel) -> RoundUpdates:
            return BufferedRound(
                model, rule=rule(), capacity=self.devices_per_round, missing_as_zero=missing_as_zero
            )

        return open_round

    def _rule(self) -> tuple[Callable[[], RobustRule], bool]:
        raise NotImplementedError


@dataclass(frozen=True, slots=True, kw_only=True)
class FedMedianParams(RobustParams):
    """FedMedian's parameters: FedAvg's rounds (``devices_per_round`` required)."""

    def _rule(self) -> tuple[Callable[[], RobustRule], bool]:
        return Median, False


@dataclass(frozen=True, slots=True, kw_only=True)
class FedTrimmedAvgParams(RobustParams):
    """FedTrimmedAvg's parameters: the fraction cut from each end (Flower's default 0.2)."""

    beta: float = 0.2

    def __post_init__(self) -> None:
        RobustParams.__post_init__(self)
        if not (math.isfinite(self.beta) and 0.0 <= self.beta < 0.5):
            raise InvalidArgument(f"beta must be in [0, 0.5), not {self.beta}")

    def _rule(self) -> tuple[Callable[[], RobustRule], bool]:
        beta = self.beta
        return (lambda: TrimmedMean(beta)), False


@dataclass(frozen=True, slots=True, kw_only=True)
class KrumParams(RobustParams):
    """Krum's and Multi-Krum's parameters: malicious devices assumed, results averaged."""

    num_malicious: int = 0
    num_to_select: int = 1

    def __post_init__(self) -> None:
        RobustParams.__post_init__(self)
        if not 0 <= self.num_malicious < self.devices_per_round:
            raise InvalidArgument(
                f"num_malicious must be in [0, devices_per_round), not {self.num_malicious}"
            )
        if not 1 <= self.num_to_select <= self.devices_per_round:
            raise InvalidArgument(
                f"num_to_select must be in [1, devices_per_round], not {self.num_to_select}"
            )

    def _rule(self) -> tuple[Callable[[], RobustRule], bool]:
        f, m = self.num_malicious, self.num_to_select
        return (lambda: Krum(num_malicious=f, num_to_select=m)), True
