"""Folding a round's results into the running average as they arrive, in the canonical order.

A FedAvg round's results are aggregated in one canonical order, so that the same results give the same
bits: the order in which their tasks were handed out, and within one hand-out by device id
(:func:`canonical_order`). Reading them all back from the store when the round closes makes the close
wait for every result to be read, decoded and folded. :class:`RoundFold` instead folds each accepted
result as soon as every result before it in that order is folded, from the decoded update the report
path hands over in-process (:meth:`RoundFold.offer`, then :meth:`RoundFold.settle` once the store has
recorded the report): when the round closes only the results it could not fold yet are left.

It is only ever a head start. The store stays the truth: at the close, :meth:`RoundFold.finish` takes the
round's accepted results as the store lists them, checks that what it folded is their first part, exactly
(same tasks, same reports), and folds the rest, from the updates it holds or else from the store. A result
recorded by another replica, or before a restart, was never handed over: it is read from the store. If
what was folded is not a prefix of the final order (a task handed out later with an earlier place), the
fold starts again from the store.

A coordinator whose store is thrown away at the end (the simulation's) may skip storing the payload of a
result this fold holds (``keep_folded_payloads=False`` in the device protocol): the result row keeps its
metadata only, and the fold is its only copy. Memory is bounded: the fold holds at most ``budget_bytes``
of updates not yet folded, and declines the rest, which then take the store's path.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from numpy.typing import NDArray

from fedlink.common.dxo import DXO, DataKind, weight_of
from fedlink.common.errors import FailedPrecondition, InvalidArgument
from fedlink.server.coordination.progress import UpdateSink
from fedlink.server.domain import Result, ResultStatus, Task
from fedlink.server.domain.updates import VariableSpec, model_spec
from fedlink.server.workflows.aggregation import WeightedAverage

log = logging.getLogger(__name__)

#: Updates with more elements than this are folded in a worker thread (numpy releases the GIL), so the
#: event loop goes on serving devices meanwhile. Smaller ones (up to ~30 ms of work) are folded on the
#: loop: a worker thread retakes the GIL after each numpy call, and while the loop is busy each retake
#: waits out the interpreter's switch interval (5 ms): a 1,000,000-float fold took 20-40 ms that way
#: against 2-3 ms on the loop.
THREAD_ELEMENTS = 1 << 24

#: Canonical place of a result: (its task's creation time, its device id).
OrderKey = tuple[datetime, str]


class LazyModel:
    """A round's global model, its spec known up front and its arrays loaded the first time they are needed.

    A model of a GiB decoded at the start of a round would sit in memory while devices download it; the
    round needs the arrays only to fold a WEIGHTS result (as its difference to the model) and to apply
    the average at the close. Concurrent askers share one load, made in the first asker's task (a
    cancelled asker leaves no read running behind it; the next one loads again).
    """

    def __init__(
        self, spec: Mapping[str, VariableSpec], load: Callable[[], Awaitable[Mapping[str, NDArray[Any]]]]
    ) -> None:
        self.spec = dict(spec)
        self._load = load
        self._loading = asyncio.Lock()
        #: The arrays, once loaded.
        self.loaded: Mapping[str, NDArray[Any]] | None = None

    @classmethod
    def of(cls, arrays: Mapping[str, NDArray[Any]]) -> LazyModel:
        """A model already in memory."""

        async def loaded() -> Mapping[str, NDArray[Any]]:
            return arrays

        model = cls(model_spec(arrays), loaded)
        model.loaded = arrays
        return model

    async def arrays(self) -> Mapping[str, NDArray[Any]]:
        """The model's arrays (loaded now if no one asked before)."""
        if self.loaded is not None:
            return self.loaded
        async with self._loading:
            if self.loaded is None:
                self.loaded = await self._load()  # a failed load is tried again by the next asker
            return self.loaded


def canonical_order(results: Sequence[Result], tasks: Mapping[str, Task]) -> list[Result]:
    """``results`` in aggregation order: by their task's creation time, then by device id."""
    return sorted(results, key=lambda r: (tasks[r.task_id].created_at, r.device_id))


class ExactSum:
    """A sum of floats kept exact until it is read (Shewchuk's non-overlapping partials, as
    :func:`math.fsum` keeps them), so that the same terms give the same bits in any order.

    A handful of partials in practice: each term costs a short loop, and memory does not grow with the
    number of terms.
    """

    __slots__ = ("_partials",)

    def __init__(self) -> None:
        self._partials: list[float] = []

    def add(self, x: float) -> None:
        partials = self._partials
        i = 0
        for y in partials:
            if abs(x) < abs(y):
                x, y = y, x
            high = x + y
            low = y - (high - x)
            if low:
                partials[i] = low
                i += 1
            x = high
        partials[i:] = [x]

    def value(self) -> float:
        """The sum, correctly rounded (inf if it overflows)."""
        try:
            return math.fsum(self._partials)
        except OverflowError:
            return math.copysign(math.inf, sum(self._partials))


class MetricAverage:
    """Weighted mean of the numeric metadata the results carry (weights themselves excluded).

    Sums are exact (:class:`ExactSum`): results folded as they arrive, in whatever order, give the same
    metrics to the bit, as the models they come with do.
    """

    _SKIP = frozenset({"num_examples", "num_steps_current_round", "model_version"})

    def __init__(self) -> None:
        self._sums: dict[str, ExactSum] = {}
        self._weights: dict[str, ExactSum] = {}

    def add(self, meta: Mapping[str, Any], weight: float) -> None:
        for key, value in meta.items():
            if key in self._SKIP or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            term = weight * float(value)
            if not math.isfinite(term):
                continue
            if key not in self._sums:
                self._sums[key], self._weights[key] = ExactSum(), ExactSum()
            self._sums[key].add(term)
            self._weights[key].add(weight)

    def result(self) -> dict[str, float]:
        return {k: self._sums[k].value() / self._weights[k].value() for k in sorted(self._sums)}


async def evaluation_metrics(
    results: Sequence[Result], read_each: Callable[[Sequence[str]], AsyncIterator[bytes]]
) -> dict[str, float]:
    """The weighted mean (by ``num_examples``, else 1) of evaluation results' numeric metrics, in meta
    or, as the built-in trainers send them, as 0-d data; each prefixed ``eval_`` (unless it is)."""
    metrics = MetricAverage()
    async for payload in read_each([r.payload_sha256 for r in results if r.payload_sha256]):
        dxo = DXO.from_bytes(payload)
        try:
            weight = weight_of(dxo)
        except InvalidArgument:
            weight = 1.0
        scalars = {k: float(v) for k, v in dxo.data.items() if v.size == 1 and v.dtype.kind in "fiu"}
        metrics.add({**scalars, **dxo.meta}, weight)
    return {k if k.startswith("eval_") else f"eval_{k}": v for k, v in metrics.result().items()}


#: A payload above this size is decoded in a worker thread (as the report path does), not on the loop.
_DECODE_ON_LOOP_BYTES = 1 << 20


class ReportedElsewhere:
    """Takes the accepted results another replica recorded for a round into the round's updates while
    the round is open, as their reports are relayed (:meth:`Progress.heard
    <fedlink.server.coordination.progress.Progress.heard>`), so that the close finds them taken instead
    of reading them all then.

    Like the sink it feeds, only a head start: a result it could not read (or the sink declined, for
    want of room) is read from the store at the close. Reads one batch of relayed tasks at a time: their
    result rows, then their payloads, each offered to the sink and settled as accepted.
    """

    def __init__(
        self,
        sink: UpdateSink,
        *,
        results_of: Callable[[Sequence[str]], Awaitable[Sequence[Result]]],
        read_each: Callable[[Sequence[str]], AsyncIterator[bytes]],
    ) -> None:
        self._sink = sink
        self._results_of = results_of
        self._read_each = read_each
        self._pending: list[str] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        #: Results taken into the sink so far.
        self.taken = 0

    def add(self, task_ids: Sequence[str]) -> None:
        """Tasks whose reports another replica recorded (what :class:`Progress` relays)."""
        if self._stopping:
            return
        self._pending.extend(task_ids)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="reported-elsewhere")

    async def stop(self) -> None:
        """Takes what was relayed so far, then stops (the round is closing: the rest is the close's)."""
        self._stopping = True
        self._wake.set()
        task, self._task = self._task, None
        if task is not None:
            await task

    def cancel(self) -> None:
        """Stops at once (the round ended otherwise)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while True:
            if not self._pending:
                if self._stopping:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, self._pending = self._pending, []
            try:
                await self._take(batch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a store outage, a corrupted payload: the close reads the rest
                log.warning("could not read results relayed by another replica: %r", exc)

    async def _take(self, task_ids: Sequence[str]) -> None:
        found = await self._results_of(task_ids)
        wanted = [
            r
            for r in found
            if r.status is ResultStatus.SUCCEEDED and r.accepted and not r.stale and r.payload_sha256
        ]
        payloads = self._read_each([r.payload_sha256 for r in wanted if r.payload_sha256])
        for result in wanted:
            payload = await anext(payloads)
            if len(payload) > _DECODE_ON_LOOP_BYTES:
                update = await asyncio.to_thread(DXO.from_bytes, payload)
            else:
                update = DXO.from_bytes(payload)
            del payload
            if self._sink.offer(result.task_id, result.request_id, update):
                self._sink.settle(result.task_id, result.request_id, accepted=True)
                self.taken += 1


@dataclass(slots=True)
class _Held:
    request_id: str
    update: DXO
    nbytes: int
    confirmed: bool = False


class RoundFold:
    """One round's running aggregate of train results (see the module docstring).

    ``model`` is the round's global model (arrays, or a :class:`LazyModel`): WEIGHTS results are folded
    as their difference to it.
    """

    def __init__(self, model: Mapping[str, NDArray[Any]] | LazyModel, *, budget_bytes: int) -> None:
        self.model = model if isinstance(model, LazyModel) else LazyModel.of(model)
        self._spec = self.model.spec
        self._budget = budget_bytes
        self._elements = sum(math.prod(spec.shape) for spec in self._spec.values())
        self.average = WeightedAverage(self._spec)
        self.metrics = MetricAverage()
        #: The tasks handed out by this driver, in canonical order.
        self._order: list[str] = []
        self._keys: dict[str, OrderKey] = {}
        #: Tasks folded, and the request id of the report each was folded from.
        self._folded: list[tuple[str, str]] = []
        self._folded_ids: set[str] = set()
        #: The devices of the results folded, in order.
        self._devices: list[str] = []
        #: Callers of :meth:`absorbed`, by task.
        self._watchers: dict[str, list[asyncio.Future[None]]] = {}
        self._last_fold = 0.0
        #: One timer for every caller of :meth:`absorbed` (lets them all go if the fold stalls).
        self._stall_timer: asyncio.TimerHandle | None = None
        self._patience = 0.0
        self._held: dict[str, _Held] = {}
        self._held_bytes = 0
        #: Set when a task was handed out with a place before what is folded: no more folding ahead.
        self._out_of_order = False
        self._closing = False
        self._drainer: asyncio.Task[None] | None = None

    # ---- what the workflow tells it ----
    def expect(self, tasks: Sequence[Task], devices: Sequence[str]) -> None:
        """Adds tasks handed out (one per device, ``devices[i]`` the target of ``tasks[i]``)."""
        for task, device in zip(tasks, devices, strict=True):
            key = (task.created_at, device)
            if self._folded and key < self._keys[self._folded[-1][0]]:
                self._out_of_order = True
            self._keys[task.task_id] = key
            self._order.append(task.task_id)
        self._order.sort(key=self._keys.__getitem__)

    # ---- what the report path tells it ----
    def offer(self, task_id: str, request_id: str, update: DXO) -> bool:
        """Offers a validated update of a report about to be recorded; True if the fold holds it.

        Declined: a task this driver did not hand out, or already folded or held, or no room left.
        """
        if self._closing or self._out_of_order or task_id not in self._keys or task_id in self._held:
            return False
        if task_id in self._folded_ids:
            return False
        nbytes = update.nbytes()
        if self._held_bytes + nbytes > self._budget:
            return False
        self._held[task_id] = _Held(request_id, update, nbytes)
        self._held_bytes += nbytes
        return True

    def settle(self, task_id: str, request_id: str, *, accepted: bool) -> None:
        """Says what the store made of a reserved report: accepted (it counts) or not (it is dropped)."""
        held = self._held.get(task_id)
        if held is None or held.request_id != request_id:
            return
        if not accepted:
            self._release(task_id)
            return
        held.confirmed = True
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.get_running_loop().create_task(self._drain())

    def _release(self, task_id: str) -> _Held:
        held = self._held.pop(task_id)
        self._held_bytes -= held.nbytes
        return held

    async def _drain(self) -> None:
        """Folds held, confirmed updates while the next task in order has one."""
        while not self._closing and not self._out_of_order and len(self._folded) < len(self._order):
            task_id = self._order[len(self._folded)]
            held = self._held.get(task_id)
            if held is None or not held.confirmed:
                return
            await self._fold(held.update)
            self._release(task_id)
            self._folded.append((task_id, held.request_id))
            self._folded_ids.add(task_id)
            self._devices.append(self._keys[task_id][1])
            self._last_fold = asyncio.get_running_loop().time()
            for watcher in self._watchers.pop(task_id, ()):
                if not watcher.done():
                    watcher.set_result(None)

    async def _fold(self, update: DXO) -> None:
        minus = None  # WEIGHTS fold as their difference to the model (no await once it is loaded)
        if update.kind is DataKind.WEIGHTS:
            minus = self.model.loaded if self.model.loaded is not None else await self.model.arrays()
        if self._elements > THREAD_ELEMENTS:
            await asyncio.to_thread(self._fold_now, update, minus)
        else:
            self._fold_now(update, minus)

    def _fold_now(self, update: DXO, minus: Mapping[str, NDArray[Any]] | None) -> None:
        weight = weight_of(update)
        self.average.add(update.data, weight, checked=True, minus=minus)  # the report path validated it
        self.metrics.add(update.meta, weight)

    async def absorbed(self, task_id: str, *, patience: float) -> None:
        """Returns once the update held for ``task_id`` is folded (at once if none is held), or once
        the fold went ``patience`` seconds without folding anything (it waits for an earlier result).

        A caller that produces updates faster than they are folded (the simulation's virtual devices)
        waits here before producing the next, so that updates do not pile up beyond the fold's budget.
        """
        if task_id not in self._held or self._closing:
            return
        loop = asyncio.get_running_loop()
        # A future per caller: a caller that is cancelled cancels its own only.
        watcher: asyncio.Future[None] = loop.create_future()
        self._watchers.setdefault(task_id, []).append(watcher)
        self._last_fold = max(self._last_fold, loop.time())
        self._patience = patience
        if self._stall_timer is None:
            self._stall_timer = loop.call_at(self._last_fold + patience, self._check_stall)
        # A bare future and one shared timer: a wait with a timeout per caller (asyncio.wait) had cost
        # the simulation's event loop ~6 % at 10,000 devices.
        await watcher

    def _check_stall(self) -> None:
        """Lets every caller of :meth:`absorbed` go if nothing was folded (or asked) for ``patience``."""
        self._stall_timer = None
        if not self._watchers:
            return
        loop = asyncio.get_running_loop()
        due = self._last_fold + self._patience
        if loop.time() < due:
            self._stall_timer = loop.call_at(due, self._check_stall)
            return
        self._release_watchers()

    def _release_watchers(self) -> None:
        for watchers in self._watchers.values():
            for watcher in watchers:
                if not watcher.done():
                    watcher.set_result(None)
        self._watchers.clear()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    # ---- the close ----
    @property
    def count(self) -> int:
        """How many results are folded."""
        return self.average.count

    def aggregate(self) -> WeightedAverage:
        """The weighted mean of the folded updates."""
        return self.average

    def devices(self) -> list[str]:
        """The devices whose results are folded, in order (all of the round's, once finished)."""
        return list(self._devices)

    async def finish_if_all_folded(self, succeeded: int) -> bool:
        """Ends the closed round's fold if it holds every accepted result: ``succeeded`` is how many
        tasks of the round the store counts with an accepted result, once no more can be added.

        Every folded result was accepted by the store (:meth:`settle`), so as many as it counts are
        all of them. Returns False (nothing changed) otherwise: :meth:`finish` then.
        """
        await self._stop_drain()
        if self._out_of_order or len(self._folded) != succeeded:
            return False
        self._held.clear()
        self._held_bytes = 0
        return True

    async def _stop_drain(self) -> None:
        self._closing = True
        self._release_watchers()
        if self._drainer is not None:
            await self._drainer

    async def finish(
        self, results: Sequence[Result], read_each: Callable[[Sequence[str]], AsyncIterator[bytes]]
    ) -> None:
        """Folds the closed round's accepted ``results`` (in canonical order) that are not folded yet.

        Raises:
            FailedPrecondition: a result's payload was neither kept by the store nor held here (only
                possible with ``keep_folded_payloads=False`` and a task handed out out of order).
        """
        await self._stop_drain()
        done = len(self._folded)
        prefix = [(r.task_id, r.request_id) for r in results[:done]]
        if prefix != self._folded:  # not a prefix of the final order: fold everything again
            self.average, self.metrics, done = WeightedAverage(self._spec), MetricAverage(), 0
            self._devices = []
        rest = results[done:]
        from_memory: dict[str, DXO] = {}
        for result in rest:
            held = self._held.get(result.task_id)
            if held is not None and held.request_id == result.request_id:
                from_memory[result.task_id] = held.update
            elif result.payload_sha256 is None:
                raise FailedPrecondition(
                    f"the payload of result {result.result_id} was not kept and is not held for the round"
                )
        from_store = [r.payload_sha256 for r in rest if r.task_id not in from_memory and r.payload_sha256]
        if from_store:
            # Results this driver was never handed (another replica's not relayed in time, a restart's,
            # or more than the fold could hold): the close waits for their reads.
            log.debug("round close reads %d of %d results from the store", len(from_store), len(results))
        stored = read_each(from_store)
        for result in rest:
            update = from_memory.get(result.task_id)
            if update is None:
                update = DXO.from_bytes(await anext(stored))
            await self._fold(update)
            self._devices.append(result.device_id)
        self._held.clear()
        self._held_bytes = 0
