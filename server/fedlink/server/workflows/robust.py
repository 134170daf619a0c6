"""Robust aggregation: the coordinate-wise median, the trimmed mean, Krum and Multi-Krum.

These rules look at all of a round's updates together, so they cannot stream as FedAvg's mean does: a
round holds its updates in memory. The bound is explicit: a round aggregates at most
``devices_per_round`` results (the first that many accepted ones in the canonical order: a retried
round's extra results are recorded, not aggregated), so it holds at most ``devices_per_round`` updates
of the model's size, plus the round's model and the new one; a job whose ``devices_per_round`` times the
model's size exceeds the coordinator's ``max_buffered_round_bytes`` is refused at submission.

Each accepted update is copied, as it arrives, into the round's rows: one array per variable of
``devices_per_round`` rows (allocated zeroed on first use, so rows no update reached take no memory),
as its difference to the round's model in the model's dtype; the decoded update is then dropped (an
:class:`~fedlink.server.coordination.progress.UpdateSink`: no payload is read back at the close
unless another replica or an earlier process recorded it). So a round holds its rows, plus the
updates still being copied; at the close the rows are brought into place (moved within the arrays)
and the aggregate is computed a block of coordinates at a time in float64 (2 MiB of scratch:
:meth:`RobustAggregate.steps`) into the new model.

Results, as Flower 1.42 computes them (its FedMedian, FedTrimmedAvg, Krum and MultiKrum):

- median and trimmed mean are unweighted, per variable over the results that carry it, and do not
  depend on the order of the results at all: the same updates give the same bits;
- Krum scores each result by the sum of its squared distances (over every variable; a variable a result
  leaves out counts as unchanged) to its ``n - f - 2`` nearest others (at least 1), and averages the
  ``m`` best, weighted as FedAvg weighs. Ties are broken by the canonical order, and the chosen are
  averaged in that order, so the same updates give the same bits there too.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from fedlink.common.dxo import DXO, DataKind, weight_of
from fedlink.common.errors import FailedPrecondition, InvalidArgument
from fedlink.server.domain import Result, Task
from fedlink.server.domain.updates import VariableSpec
from fedlink.server.workflows.aggregation import difference
from fedlink.server.workflows.fedavg import FedAvgParams, RoundRule, RoundUpdates
from fedlink.server.workflows.folding import THREAD_ELEMENTS, LazyModel, MetricAverage, OrderKey

#: Float64 elements of one block of coordinates (rows × columns): 2 MiB of scratch, small beside a
#: round of rows (a smaller block did not make the rules slower, 100 rows × 1,000,000 floats).
_BLOCK_ELEMENTS = 1 << 18


class RobustRule(Protocol):
    """Turns a round's updates (rows of differences) into its aggregate, a block at a time."""

    #: Whether the rows must come in the results' canonical order (else in any order: the rule's
    #: result does not depend on it).
    ordered: bool

    def prepare(self, stacks: Mapping[str, NDArray[Any]], weights: NDArray[np.float64]) -> None:
        """Sees every variable's rows before any block is asked for (Krum chooses here)."""
        ...

    def block(self, name: str, rows: NDArray[np.float64]) -> NDArray[np.float64]:
        """The aggregate of one block of a variable's coordinates (``rows``: results × columns)."""
        ...


class Median:
    """The coordinate-wise median (an even count averages its two middle values, in float64)."""

    ordered = False

    def prepare(self, stacks: Mapping[str, NDArray[Any]], weights: NDArray[np.float64]) -> None:
        """Nothing to prepare."""

    def block(self, name: str, rows: NDArray[np.float64]) -> NDArray[np.float64]:
        """The median of each column."""
        result: NDArray[np.float64] = np.median(rows, axis=0, overwrite_input=True)
        return result


class TrimmedMean:
    """The coordinate-wise mean after cutting ``floor(beta * n)`` values from each end."""

    ordered = False

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

    ordered = True  # ties go to the first in canonical order, and the rows' order can move the bits

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
            # Distances do not change when every row moves by the same vector: each block is centred
            # on its column means first, so the Gram matrix's cancellation (|a|^2 + |b|^2 - 2ab) costs
            # the spread's precision, not the values'. Then float32 products suffice for a float32
            # model (half the time of float64: 2e-8 relative error in the distances of 100 x 1M
            # floats), summed over the blocks in float64.
            dtype: type[np.floating[Any]] = np.float64 if flat.dtype == np.float64 else np.float32
            width = max(1, _BLOCK_ELEMENTS // max(1, n))
            for start in range(0, flat.shape[1], width):
                block: NDArray[np.floating[Any]] = flat[:, start : start + width].astype(dtype)
                block -= block.mean(axis=0, dtype=np.float64).astype(dtype)
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


@dataclass(slots=True, frozen=True)
class _Copied:
    """An accepted update whose values are in the round's rows: where, and what else it said."""

    request_id: str
    slot: int
    weight: float
    meta: Mapping[str, Any]
    names: frozenset[str]


class _Rows:
    """Each variable's rows, one per slot (``capacity`` of them, allocated zeroed on first use: pages
    no update was written to take no memory), filled as accepted updates arrive."""

    def __init__(self, spec: Mapping[str, VariableSpec], capacity: int) -> None:
        self._spec = spec
        self._capacity = capacity
        self.stacks: dict[str, NDArray[Any]] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def take(self) -> int:
        """A free slot (the lowest)."""
        return self._free.pop()

    def write(self, slot: int, update: DXO, base: Mapping[str, NDArray[Any]] | None) -> None:
        """Copies ``update``'s variables (as differences to ``base`` for WEIGHTS) into ``slot``'s rows."""
        for name, array in update.data.items():
            stack = self.stacks.get(name)
            if stack is None:
                variable = self._spec[name]
                stack = self.stacks[name] = np.zeros((self._capacity, *variable.shape), variable.dtype)
            row = stack[slot]
            if update.kind is not DataKind.WEIGHTS:
                row[...] = array
                continue
            value = difference(array, _base(base)[name], out=row)
            if value is not row:  # computed in float64 and rounded: not written in place
                row[...] = value

    def free(self, slot: int, names: frozenset[str]) -> None:
        """Gives ``slot`` back, its rows zeroed (a later update that lacks a variable reads zeros)."""
        for name in names:
            stack = self.stacks.get(name)
            if stack is not None:
                stack[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    def arrange(self, order: Mapping[str, Sequence[int]]) -> dict[str, NDArray[Any]]:
        """Each variable's rows, the slots ``order[name]`` lists brought in place to rows 0, 1, ... (one
        row of scratch per variable): views of the first ``len(order[name])`` rows."""
        arranged: dict[str, NDArray[Any]] = {}
        for name, slots in order.items():
            stack = self.stacks[name]
            _permute_rows(stack, slots)
            arranged[name] = stack[: len(slots)]
        return arranged


def _permute_rows(stack: NDArray[Any], slots: Sequence[int]) -> None:
    """In place: row ``k`` becomes what row ``slots[k]`` held, for each ``k`` (the slots distinct);
    rows past ``len(slots)`` are left in any order. Follows the permutation's cycles."""
    if list(slots) == list(range(len(slots))):
        return
    capacity = stack.shape[0]
    tail = range(len(slots), capacity)
    unused = set(range(capacity)) - set(slots)
    stay = unused.intersection(tail)
    movers = sorted(unused - stay)
    source = [*slots, *(k if k in stay else movers.pop() for k in tail)]  # row k takes source[k]
    done = [False] * capacity
    for start in range(capacity):
        if done[start] or source[start] == start:
            done[start] = True
            continue
        scratch = stack[start].copy()
        k = start
        while True:
            done[k] = True
            nxt = source[k]
            if nxt == start:
                stack[k] = scratch
                break
            stack[k] = stack[nxt]
            k = nxt


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
        #: Offered updates not copied yet (awaiting the store's word, or the copier).
        self._held: dict[str, _Held] = {}
        #: Accepted updates whose values are in the rows.
        self._copied: dict[str, _Copied] = {}
        self._rows = _Rows(model.spec, capacity)
        self._copier: asyncio.Task[None] | None = None
        #: Set when a task's update is in the rows (for :meth:`absorbed`).
        self._copied_signals: dict[str, asyncio.Future[None]] = {}
        self._closing = False
        #: What the close took, in canonical order: (device, weight).
        self._taken: list[tuple[str, float]] = []
        self._aggregate: RobustAggregate | None = None

    # ---- the UpdateSink ----
    def offer(self, task_id: str, request_id: str, update: DXO) -> bool:
        """Holds a validated update of a task this round handed out, while there is room."""
        if self._closing or task_id not in self._keys or task_id in self._held or task_id in self._copied:
            return False
        if len(self._held) + len(self._copied) >= self._capacity:
            return False
        self._held[task_id] = _Held(request_id, update)
        return True

    def settle(self, task_id: str, request_id: str, *, accepted: bool) -> None:
        """Copies an accepted update into the round's rows (soon: its own task); drops one the store
        did not accept."""
        held = self._held.get(task_id)
        if held is None or held.request_id != request_id:
            return
        if not accepted:
            del self._held[task_id]
            self._signal_copied(task_id)
            return
        held.confirmed = True
        if self._closing:
            return  # the close takes it (the store counts it) from what is held
        if self._copier is None or self._copier.done():
            self._copier = asyncio.get_running_loop().create_task(self._copy_confirmed())

    async def absorbed(self, task_id: str, *, patience: float) -> None:
        """Returns once the update held for ``task_id`` is in the rows (at once if none is held), or
        after ``patience`` seconds: a caller producing updates faster than they are copied (the
        simulation's virtual devices) waits here, so that a round does not hold each update twice."""
        if task_id not in self._held or self._closing:
            return
        copied = self._copied_signals.get(task_id)
        if copied is None:
            copied = self._copied_signals[task_id] = asyncio.get_running_loop().create_future()
        await asyncio.wait({copied}, timeout=patience)

    async def _copy_confirmed(self) -> None:
        while True:
            confirmed = [t for t, held in self._held.items() if held.confirmed]
            if not confirmed:
                return
            for task_id in confirmed:
                held = self._held[task_id]
                await self._copy(task_id, held.request_id, held.update)
                del self._held[task_id]  # the rows hold its values from here: let the update go

    async def _copy(self, task_id: str, request_id: str, update: DXO) -> None:
        base = await self.model.arrays() if update.kind is DataKind.WEIGHTS else None
        copied = _Copied(request_id, -1, weight_of(update), dict(update.meta), frozenset(update.data))
        slot = self._rows.take()
        try:
            if sum(a.size for a in update.data.values()) > THREAD_ELEMENTS:
                await asyncio.to_thread(self._rows.write, slot, update, base)
            else:
                self._rows.write(slot, update, base)
        except BaseException:
            self._rows.free(slot, copied.names)  # a partly written slot goes back zeroed
            raise
        self._copied[task_id] = replace(copied, slot=slot)
        self._signal_copied(task_id)

    def _signal_copied(self, task_id: str) -> None:
        """Lets the callers of :meth:`absorbed` for ``task_id`` go."""
        signal = self._copied_signals.pop(task_id, None)
        if signal is not None and not signal.done():
            signal.set_result(None)

    async def _stop_copying(self) -> None:
        self._closing = True
        while self._copier is not None and not self._copier.done():
            await self._copier
        for signal in self._copied_signals.values():
            if not signal.done():
                signal.set_result(None)
        self._copied_signals.clear()

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
        await self._stop_copying()
        if len(self._copied) != succeeded:
            return False
        self._held.clear()
        ordered = sorted(self._copied, key=self._keys.__getitem__)
        self._close([(self._keys[t][1], t) for t in ordered])
        return True

    async def finish(
        self, results: Sequence[Result], read_each: Callable[[Sequence[str]], AsyncIterator[bytes]]
    ) -> None:
        """Takes the first ``capacity`` of the closed round's accepted ``results`` (canonical order),
        from what it holds or else from the store.

        Raises:
            FailedPrecondition: a result's payload was neither kept by the store nor held here.
        """
        await self._stop_copying()
        chosen = list(results[: self._capacity])
        wanted = {(r.task_id, r.request_id) for r in chosen}
        for task_id, copied in list(self._copied.items()):
            if (task_id, copied.request_id) not in wanted:
                del self._copied[task_id]  # room first for what the store has to give
                self._rows.free(copied.slot, copied.names)
        held = {t: h.update for t, h in self._held.items() if (t, h.request_id) in wanted}
        self._held.clear()
        for result in chosen:
            if result.task_id in held:  # accepted, its settle not seen before the close
                await self._copy(result.task_id, result.request_id, held.pop(result.task_id))
        missing = [r for r in chosen if r.task_id not in self._copied]
        for result in missing:
            if result.payload_sha256 is None:
                raise FailedPrecondition(
                    f"the payload of result {result.result_id} was not kept and is not held for the round"
                )
        stored = read_each([r.payload_sha256 for r in missing if r.payload_sha256])
        for result in missing:
            await self._copy(result.task_id, result.request_id, DXO.from_bytes(await anext(stored)))
        self._close([(r.device_id, r.task_id) for r in chosen])

    def _close(self, taken: list[tuple[str, str]]) -> None:
        """Brings the taken results' rows into place (canonical order where the rule asks for it) and
        lets the rule prepare."""
        copied = [self._copied[task_id] for _, task_id in taken]
        slots = [c.slot for c in copied]
        if not self._rule.ordered:
            slots.sort()  # no row moves when nothing was dropped
        by_slot = {c.slot: c for c in copied}
        names = {name for c in copied for name in c.names}
        order = {
            name: slots if self._missing_as_zero else [s for s in slots if name in by_slot[s].names]
            for name in sorted(names)
        }
        stacks = self._rows.arrange(order)
        weights = np.array([by_slot[s].weight for s in slots], dtype=np.float64)
        for (device, _), c in zip(taken, copied, strict=True):
            self.metrics.add(c.meta, c.weight)  # canonical order
            self._taken.append((device, c.weight))
        self._copied.clear()
        self._rule.prepare(stacks, weights)
        self._aggregate = RobustAggregate(stacks, self._rule)


def _base(model: Mapping[str, NDArray[Any]] | None) -> Mapping[str, NDArray[Any]]:
    assert model is not None, "a WEIGHTS update is taken against the round's model, loaded for it"
    return model


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
