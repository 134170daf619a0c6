"""FedBuff: asynchronous buffered aggregation (Nguyen et al. 2022), as NVIDIA FLARE's edge workflow.

No rounds: a **selection** of ``device_selection_size`` devices holds a ``train`` task each, on the
global model version current when it got the task. A slot is freed when its device reports (success or
failure), releases its task, lets its lease expire, does not pick its task up within
``pickup_timeout`` or does not report by ``task_timeout``; once ``min_hole_to_fill`` slots are free
they are refilled with devices sampled among the eligible ones not in the selection (and, without
``device_reuse``, never given a task of the job before). Every accepted update goes into the
:class:`~fedlink.server.workflows.buffer.UpdateBuffer` as it arrives; after ``num_updates_for_model``
of them (from any versions) the buffer makes the next global model. When version ``V`` is made, tasks
of versions ``V - max_model_history`` and older are closed: a report for one later is STALE (recorded,
not aggregated). The job finishes when version ``max_model_version`` is made.

Versions are numbered as FedAvg's rounds: 0 is the job's initial model, and the run's checkpoint
``round`` is the latest version (FLARE numbers the initial model 1: its ``max_model_version = N``
makes N - 1 new models, ours makes N).

**Durability.** The store is the truth; nothing is lost with the process. Each new version is a
checkpoint whose workflow state lists the tasks still out on older versions (``pending``) and the
counters; the tasks handed out since are those of the checkpoint's version (a task's ``round`` is the
version it carries, and tasks on a version are created only after its checkpoint). A restarted
coordinator reads those tasks' assignments and folds every accepted result they have that no version
consumed yet, so an acknowledged update counts exactly once. Updates are folded in double-double
(see the buffer's docstring): the restart folds them in another order and makes the same model.

**In process.** The report path hands each validated update over as it is recorded (an
:class:`~fedlink.server.coordination.progress.UpdateSink`), so the workflow rarely reads a payload back;
it reads the selection's assignments from the store when a signal it was not handed an update for came
(a failure, a release, an expiry), when a pickup or task deadline passes, and at least every
``poll_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

import numpy as np
from numpy.typing import NDArray

from fedlink.common.dxo import DXO, DataKind, MetaKey, weight_of
from fedlink.common.errors import FailedPrecondition, InvalidArgument
from fedlink.server.domain import (
    EVALUATE_TASK,
    TRAIN_TASK,
    Assignment,
    AssignmentState,
    Result,
    ResultStatus,
    Run,
    Task,
    TaskState,
)
from fedlink.server.domain.updates import model_spec
from fedlink.server.store import StateStore
from fedlink.server.workflows.base import Event, WorkflowContext
from fedlink.server.workflows.buffer import UpdateBuffer
from fedlink.server.workflows.device_pool import DevicePool
from fedlink.server.workflows.folding import THREAD_ELEMENTS, LazyModel, evaluation_metrics
from fedlink.server.workflows.params import WorkflowParams, seconds_field

log = logging.getLogger(__name__)

#: The event of a new global model: its update count, their staleness histogram and metrics.
MODEL_VERSION_EVENT = "model_version"
#: Bytes of reported updates the in-process hand-over may hold before the workflow takes them.
_HELD_BYTES = 256 * 1024**2
_LOST = frozenset({AssignmentState.EXPIRED, AssignmentState.RELEASED})
#: The longest the workflow waits for the report path to settle a report the store recorded.
_SETTLE_WAIT_S = 5.0
#: How old the list of eligible devices a refill samples from may be (reading it walks every online
#: device: at 100,000 devices, once per refill made the run quadratic), and how old when it falls short.
_ELIGIBLE_MAX_AGE_S = 10.0
_ELIGIBLE_SHORT_AGE_S = 1.0
#: The last entry of an evaluation sample's seed, so that it never draws the training samples' numbers.
_EVAL_STREAM = 0xE7A1


@dataclass(frozen=True, slots=True, kw_only=True)
class FedBuffParams(WorkflowParams):
    """FedBuff's parameters (the proto's FedBuffConfig): NVIDIA FLARE's names and meanings
    (``BuffModelManager``, ``BuffDeviceManager``, ``ModelUpdateAssessor``), defaults of its classes."""

    #: The job finishes once this global model version is made (version 0 is the initial model).
    max_model_version: int
    #: Accepted updates (from any versions) that make the next global model (FLARE's K).
    num_updates_for_model: int = 100
    #: An update whose version is this many versions behind the current one is STALE; 0: no limit.
    max_model_history: int = 10
    #: The step: new model = model + global_lr * the buffer's weighted mean update.
    global_lr: float = 1.0
    #: Weigh each version's updates by 1 / (1 + sqrt(staleness)) instead of 1.
    staleness_weight: bool = False
    #: How an update weighs within the buffer: by its ``num_examples`` (FedAvg's weight), or 1 per
    #: device (FLARE's device count).
    update_weight: Literal["num_examples", "device"] = "num_examples"
    #: Devices holding a task at once.
    device_selection_size: int = 100
    #: Free slots needed before the selection is refilled.
    min_hole_to_fill: int = 1
    #: Whether a device may get another task after it reported one.
    device_reuse: bool = True
    #: How devices are sampled: the least used first (``balanced``) or uniformly (``random``).
    device_sampling_strategy: Literal["balanced", "random"] = "balanced"
    #: Fail the job once the selection could not be filled for this long; 0 waits for ever.
    device_wait_timeout_s: float = seconds_field(0.0)
    #: How long a device has to report its task; a later report is STALE and its slot is refilled.
    task_timeout_s: float = seconds_field(600.0)
    #: How long a sampled device has to pick up its task before its slot goes to another device.
    pickup_timeout_s: float = seconds_field(30.0)
    #: Seed of the sampling generator.
    seed: int = 0
    #: Model version checkpoints kept besides the final model.
    keep_checkpoints: int = 3
    #: Evaluate every this many versions (each version it divides), as NVIDIA FLARE's
    #: ``GlobalEvaluator(eval_frequency=N)``: an ``evaluate`` task with the new model goes to
    #: ``eval_devices`` devices outside the selection; 0 never evaluates.
    eval_frequency: int = 0
    #: Devices that evaluate a version (fewer when fewer eligible devices are outside the selection).
    eval_devices: int = 10

    def __post_init__(self) -> None:
        for name in (
            "max_model_version",
            "num_updates_for_model",
            "device_selection_size",
            "min_hole_to_fill",
            "eval_devices",
        ):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be at least 1")
        for name in ("max_model_history", "keep_checkpoints", "eval_frequency"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must not be negative")
        if self.min_hole_to_fill > self.device_selection_size:
            raise InvalidArgument("min_hole_to_fill cannot exceed device_selection_size")
        if not (math.isfinite(self.global_lr) and self.global_lr > 0):
            raise InvalidArgument("global_lr must be a positive number")
        if self.update_weight not in ("num_examples", "device"):
            raise InvalidArgument("update_weight must be 'num_examples' or 'device'")
        if self.device_sampling_strategy not in ("balanced", "random"):
            raise InvalidArgument("device_sampling_strategy must be 'balanced' or 'random'")
        if not (math.isfinite(self.device_wait_timeout_s) and self.device_wait_timeout_s >= 0):
            raise InvalidArgument("device_wait_timeout must not be negative")
        for name in ("task_timeout_s", "pickup_timeout_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise InvalidArgument(f"{name.removesuffix('_s')} must be positive")

    @property
    def num_steps(self) -> int:
        """The model versions to make."""
        return self.max_model_version

    @property
    def task_names(self) -> tuple[str, ...]:
        """``train``, and ``evaluate`` when versions are evaluated."""
        return (TRAIN_TASK, EVALUATE_TASK) if self.eval_frequency else (TRAIN_TASK,)

    def evaluates(self, version: int) -> bool:
        """Whether ``version`` is evaluated (every ``eval_frequency``-th made one; never the initial 0)."""
        return self.eval_frequency > 0 and version > 0 and version % self.eval_frequency == 0

    def live_versions(self) -> int:
        """The most model versions whose updates the buffer may hold at once."""
        bound = self.max_model_version + 1
        return min(self.max_model_history, bound) if self.max_model_history else bound

    def check_memory(self, *, model_bytes: int, max_buffered_round_bytes: int) -> None:
        """Refuses a run whose buffer (a float64 pair per element and live version) would exceed the
        coordinator's ``max_buffered_round_bytes``.

        Raises:
            InvalidArgument: naming the setting.
        """
        needed = 4 * model_bytes * self.live_versions()
        if needed > max_buffered_round_bytes:
            raise InvalidArgument(
                f"fedbuff would buffer up to {needed} bytes ({self.live_versions()} live versions of "
                f"4 x {model_bytes} bytes), more than the coordinator's max_buffered_round_bytes "
                f"({max_buffered_round_bytes}); lower max_model_history"
            )


# ---- the in-process hand-over ------------------------------------------------------------------------


@dataclass(slots=True)
class _Held:
    request_id: str
    update: DXO
    nbytes: int
    settled: bool = False


class Arrivals:
    """The updates the report path hands over in-process (an :class:`UpdateSink`), in arrival order.

    Holds an offered update until the store has judged its report; an accepted one then waits in
    :attr:`queue` for the workflow to take it. Declines what it cannot hold (a task not in the
    selection, no room left): that update is read from the store instead.
    """

    def __init__(self, wanted: Callable[[str], bool], *, budget_bytes: int = _HELD_BYTES) -> None:
        self._wanted = wanted
        self._budget = budget_bytes
        self._held: dict[str, _Held] = {}
        self._bytes = 0
        self._watchers: dict[str, list[asyncio.Future[None]]] = {}
        self._judging: dict[str, list[asyncio.Future[None]]] = {}
        #: Tasks whose accepted update waits to be taken, in the order they were settled.
        self.queue: deque[str] = deque()
        #: How many offered updates the store accepted (each came with one progress signal).
        self.settled = 0

    def offer(self, task_id: str, request_id: str, update: DXO) -> bool:
        """Holds a validated update about to be recorded, if its task is in the selection and it fits."""
        if task_id in self._held or not self._wanted(task_id):
            return False
        nbytes = update.nbytes()
        if self._bytes + nbytes > self._budget:
            return False
        self._held[task_id] = _Held(request_id, update, nbytes)
        self._bytes += nbytes
        return True

    def settle(self, task_id: str, request_id: str, *, accepted: bool) -> None:
        """Queues an accepted update for the workflow; drops one the store did not accept."""
        held = self._held.get(task_id)
        if held is None or held.request_id != request_id or held.settled:
            return
        self._wake(self._judging, task_id)
        if not accepted:
            self.drop(task_id)
            return
        held.settled = True
        self.settled += 1
        self.queue.append(task_id)

    def take(self, task_id: str) -> DXO | None:
        """The settled update held for ``task_id`` (no longer held), or None."""
        held = self._held.get(task_id)
        if held is None or not held.settled:
            return None
        self.drop(task_id)
        return held.update

    def holds_unsettled(self, task_id: str) -> bool:
        """True while an update for ``task_id`` is held and the store has not judged its report."""
        held = self._held.get(task_id)
        return held is not None and not held.settled

    def drop(self, task_id: str) -> None:
        """Forgets what is held for ``task_id`` and lets its waiters go."""
        held = self._held.pop(task_id, None)
        if held is not None:
            self._bytes -= held.nbytes
        self._wake(self._watchers, task_id)
        self._wake(self._judging, task_id)

    @staticmethod
    def _wake(waiting: dict[str, list[asyncio.Future[None]]], task_id: str) -> None:
        for waiter in waiting.pop(task_id, ()):
            if not waiter.done():
                waiter.set_result(None)

    def clear(self) -> None:
        """Forgets everything (the run is over)."""
        for task_id in list(self._held):
            self.drop(task_id)
        self.queue.clear()

    async def absorbed(self, task_id: str, *, patience: float) -> None:
        """Returns once nothing is held for ``task_id`` any more, or after ``patience`` seconds."""
        if task_id in self._held:
            await self._wait(self._watchers, task_id, patience)

    async def judged(self, task_id: str, *, patience: float) -> None:
        """Returns once the store's judgement of the report held for ``task_id`` is settled (at once if
        none is held unsettled), or after ``patience`` seconds."""
        if self.holds_unsettled(task_id):
            await self._wait(self._judging, task_id, patience)

    @staticmethod
    async def _wait(waiting: dict[str, list[asyncio.Future[None]]], task_id: str, patience: float) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting.setdefault(task_id, []).append(waiter)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(patience):
                await waiter


# ---- the workflow ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Slot:
    """A task held by one device of the selection."""

    task: Task
    device: str
    #: Whether the store showed an assignment for it (its device picked it up).
    claimed: bool = False
    #: Whether its update is folded (into the buffer, or the version just made).
    taken: bool = False

    @property
    def version(self) -> int:
        return self.task.round


@dataclass(slots=True)
class _Counters:
    """What became of the tasks handed out (durable through the checkpoints' state)."""

    updates: int = 0
    failed: int = 0
    lost: int = 0
    stale: int = 0
    handed_out: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "updates": self.updates,
            "failed": self.failed,
            "lost": self.lost,
            "stale": self.stale,
            "handed_out": self.handed_out,
        }


@dataclass(slots=True)
class _VersionEvent:
    """A version's ``model_version`` event not published yet: its evaluation is out, or an earlier
    version's is (the events go out in version order)."""

    version: int
    payload: dict[str, Any]
    #: Whether the version's evaluation is still out.
    evaluating: bool = False
    #: Its evaluation's tasks not settled yet, by task id.
    out: dict[str, _Slot] = field(default_factory=dict)
    #: Every task of its evaluation, in hand-out order (their results make its metrics).
    tasks: list[str] = field(default_factory=list)

    def as_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (its tasks are the store's: the version's ``evaluate`` tasks)."""
        return {"version": self.version, "payload": self.payload, "evaluating": self.evaluating}


class FedBuff:
    """The FedBuff workflow (see the module docstring)."""

    def __init__(
        self,
        params: FedBuffParams,
        *,
        poll_seconds: float = 1.0,
        min_check_seconds: float | None = None,
    ) -> None:
        self.params = params
        self._poll = poll_seconds
        self._min_check = min(0.05 if min_check_seconds is None else min_check_seconds, poll_seconds)
        self._slots: dict[str, _Slot] = {}
        self._arrivals = Arrivals(lambda task_id: task_id in self._slots)
        self._version = 0
        self._model: Mapping[str, NDArray[Any]] = {}
        self._model_sha = ""
        self._models: dict[int, LazyModel] = {}
        self._buffer = UpdateBuffer({})
        self._uses: Counter[str] = Counter()
        self._candidates = DevicePool()
        self._on_version = 0
        self._counters = _Counters()
        self._short_since: datetime | None = None
        #: Eligible devices outside the selection at the last refill (for the device wait's message).
        self._usable = 0
        #: Tasks reported (or lost) since the last version, still OPEN in the store: closed with the next.
        self._done: list[str] = []
        self._signals_read = 0
        self._settled_read = 0
        self._last_read = -math.inf
        #: Per version, how many updates of its tasks were folded (kept for the versions with tasks out).
        self._folded: Counter[int] = Counter()
        #: The versions whose events wait for an evaluation (theirs or an earlier one's), in order.
        self._unpublished: deque[_VersionEvent] = deque()
        #: The latest checkpoint's metrics and workflow state (without the unpublished events), which
        #: :meth:`_save` writes again when an evaluation ends.
        self._metrics: dict[str, float] = {}
        self._checkpoint_state: dict[str, Any] = {}

    # ---- the run ----
    async def run(self, ctx: WorkflowContext) -> None:
        """Makes model versions from the run's last checkpoint up to ``max_model_version``."""
        ctx.progress.sink = self._arrivals
        try:
            tracked = await self._restore(ctx)
            await self._look(ctx, tracked)
            while self._version < self.params.max_model_version:
                await self._step(ctx)
            await self._finish_evaluations(ctx)
        finally:
            ctx.progress.sink = None
            self._arrivals.clear()

    async def _step(self, ctx: WorkflowContext) -> None:
        """Takes what arrived, looks at the selection in the store when due, refills it, then waits."""
        await self._take_arrivals(ctx)
        if self._version >= self.params.max_model_version:
            return
        loop = asyncio.get_running_loop()
        now = ctx.clock.now()
        progress = ctx.progress
        unexplained = (progress.signals - self._signals_read) - (self._arrivals.settled - self._settled_read)
        due = self._next_due(now)
        if (
            progress.urgent
            or (unexplained > 0 and loop.time() - self._last_read >= self._min_check)
            or (due is not None and due <= now)
            or loop.time() - self._last_read >= self._poll
        ):
            progress.urgent = False
            await self._look(ctx, list(self._slots.values()))
            if self._version >= self.params.max_model_version:
                return
        await self._refill(ctx)
        self._check_wait(ctx.clock.now())
        if self._arrivals.queue:
            return
        wait = self._poll
        unexplained = (progress.signals - self._signals_read) - (self._arrivals.settled - self._settled_read)
        if unexplained > 0:  # a look is due once min_check has passed
            wait = min(wait, max(0.0, self._min_check - (loop.time() - self._last_read)))
        due = self._next_due(ctx.clock.now())
        if due is not None:
            wait = min(wait, max(0.0, (due - ctx.clock.now()).total_seconds()))
        if self._short_since is not None and self.params.device_wait_timeout_s:
            ends = self._short_since + timedelta(seconds=self.params.device_wait_timeout_s)
            wait = min(wait, max(0.0, (ends - ctx.clock.now()).total_seconds()))
        await progress.wait(wait)

    def _next_due(self, now: datetime) -> datetime | None:
        """When the selection next needs a look whatever signals come: a pickup or task deadline."""
        pickup = timedelta(seconds=self.params.pickup_timeout_s)
        due: datetime | None = None
        for slot in [*self._slots.values(), *self._evaluating()]:
            when = (
                slot.task.deadline if slot.claimed else min(slot.task.deadline, slot.task.created_at + pickup)
            )
            if due is None or when < due:
                due = when
        return due

    # ---- resuming ----
    async def _restore(self, ctx: WorkflowContext) -> list[_Slot]:
        """Loads the last checkpoint's model and state; returns the tasks whose outcome is not counted."""
        run = ctx.run
        sha = run.global_model_sha256 or ctx.job.initial_model_sha256
        if sha is None:
            raise InvalidArgument("the job has no initial model")
        self._version = run.round
        self._model_sha = sha
        self._model = DXO.from_bytes(await ctx.store.blobs.read(sha)).data
        self._models = {self._version: LazyModel.of(self._model)}
        self._buffer = UpdateBuffer(model_spec(self._model))
        state = ctx.state
        counters = state.get("counters", {})
        self._counters = _Counters(**{k: int(v) for k, v in counters.items() if k in _Counters.__slots__})
        self._folded = Counter({int(v): int(n) for v, n in dict(state.get("folded", {})).items()})
        self._metrics = {
            k: float(v) for k, v in _json_object(run.metrics_json).items() if isinstance(v, int | float)
        }
        self._checkpoint_state = {k: v for k, v in state.items() if k != "unpublished"}
        pending = set(state.get("pending", ()))
        every = await ctx.store.list_tasks(run.run_id)
        tasks = [t for t in every if t.name == TRAIN_TASK]
        targets = await ctx.store.task_targets(task_ids=[t.task_id for t in tasks])
        device_of = {t.task_id: targets[t.task_id][0] for t in tasks if targets.get(t.task_id)}
        self._uses = Counter(device_of.values())
        self._on_version = sum(1 for t in tasks if t.round == self._version)
        tracked: list[_Slot] = []
        for task in tasks:
            if (task.task_id in pending or task.round == self._version) and task.task_id in device_of:
                slot = _Slot(task, device_of[task.task_id])
                tracked.append(slot)
                if task.state is TaskState.OPEN:
                    self._slots[task.task_id] = slot
        await self._restore_evaluations(ctx, state.get("unpublished", ()), every)
        return tracked

    # ---- what the store says ----
    async def _look(self, ctx: WorkflowContext, slots: Sequence[_Slot]) -> None:
        """Reads the slots' assignments: folds accepted updates not taken yet, frees the slots of failed,
        released, expired, unclaimed and overdue tasks."""
        loop = asyncio.get_running_loop()
        self._signals_read, self._settled_read = ctx.progress.signals, self._arrivals.settled
        self._last_read = loop.time()
        evaluating = self._evaluating()
        if not slots and not evaluating:
            return
        now = ctx.clock.now()
        ids = [s.task.task_id for s in (*slots, *evaluating)]
        latest = {a.task_id: a for a in await ctx.store.list_assignments(task_ids=ids)}
        pickup = timedelta(seconds=self.params.pickup_timeout_s)
        completed: list[_Slot] = []
        lost: list[_Slot] = []
        for slot in slots:
            assignment = latest.get(slot.task.task_id)
            if assignment is not None and assignment.state is AssignmentState.COMPLETED:
                completed.append(slot)
            elif assignment is not None and assignment.state is AssignmentState.FAILED:
                self._free(slot)
                self._counters.failed += 1
            elif slot.task.task_id not in self._slots:
                self._counters.lost += 1  # closed before a restart, with no result that counts
            elif (
                (assignment is not None and assignment.state in _LOST)
                or now >= slot.task.deadline
                or (assignment is None and now >= slot.task.created_at + pickup)
            ):
                lost.append(slot)
            elif assignment is not None:
                slot.claimed = True
        completed.extend(await self._close_all(ctx, lost, reason="lost"))
        await self._take_completed(ctx, completed)
        await self._settle_evaluations(ctx, evaluating, latest, now)

    async def _close_all(self, ctx: WorkflowContext, slots: Sequence[_Slot], *, reason: str) -> list[_Slot]:
        """Closes the slots' tasks and frees them (later reports are STALE); returns those whose report the
        store accepted before the close: acknowledged, they count. The others are counted as ``reason``."""
        if not slots:
            return []
        for slot in slots:
            self._free(slot)
        ids = [s.task.task_id for s in slots]
        await ctx.store.close_tasks(ids, fence=ctx.fence)
        latest = {a.task_id: a for a in await ctx.store.list_assignments(task_ids=ids)}
        accepted: list[_Slot] = []
        for slot in slots:
            state = latest[slot.task.task_id].state if slot.task.task_id in latest else None
            if state is AssignmentState.COMPLETED:
                accepted.append(slot)
            elif state is AssignmentState.FAILED:
                self._counters.failed += 1
            elif reason == "stale":
                self._counters.stale += 1
            else:
                self._counters.lost += 1
        return accepted

    async def _take_completed(
        self, ctx: WorkflowContext, slots: Sequence[_Slot], *, into: UpdateBuffer | None = None
    ) -> None:
        """Folds the accepted updates of ``slots`` (COMPLETED in the store), those read back from the store
        in the order it recorded them; into ``into`` if given, else the buffer (making versions)."""
        found: list[tuple[_Slot, Result | None, DXO | None]] = []
        for slot in slots:
            if slot.taken:
                continue
            update, result = await self._accepted_update(ctx, slot)
            found.append((slot, result, update))
        found.sort(key=lambda f: ("", "") if f[1] is None else (f[1].created_at.isoformat(), f[1].result_id))
        for slot, result, update in found:
            if update is None:
                assert result is not None and result.payload_sha256 is not None
                update = DXO.from_bytes(await ctx.store.blobs.read(result.payload_sha256))
            if into is None:
                await self._take(ctx, slot, update)
            elif not slot.taken:
                self._free(slot)
                await self._fold(ctx, into, slot, update)
                self._counters.updates += 1

    async def _accepted_update(self, ctx: WorkflowContext, slot: _Slot) -> tuple[DXO | None, Result | None]:
        """The update of a task whose report the store accepted: handed over in-process, or else its
        stored result (to read). A report recorded but not yet settled with the hand-over is waited for:
        its payload may be held only (a store that keeps no folded payloads)."""
        task_id = slot.task.task_id
        await self._arrivals.judged(task_id, patience=_SETTLE_WAIT_S)
        held = self._arrivals.take(task_id)
        if held is not None:
            return held, None
        results = [r for r in await ctx.store.list_results(task_id=task_id) if r.accepted]
        if not results or results[0].payload_sha256 is None:
            raise FailedPrecondition(
                f"the accepted result of task {task_id} was neither stored nor handed over"
            )
        self._arrivals.drop(task_id)
        return None, results[0]

    async def _take_arrivals(self, ctx: WorkflowContext) -> None:
        """Folds the updates handed over in-process, in the order the store accepted them."""
        while self._arrivals.queue and self._version < self.params.max_model_version:
            task_id = self._arrivals.queue.popleft()
            update = self._arrivals.take(task_id)
            slot = self._slots.get(task_id)
            if update is not None and slot is not None:
                await self._take(ctx, slot, update)

    # ---- folding and new versions ----
    async def _take(self, ctx: WorkflowContext, slot: _Slot, update: DXO) -> None:
        """Folds one accepted update and frees its slot; makes a new version once enough are in."""
        if slot.taken:
            return  # folded already, by the version that closed its task
        self._free(slot)
        await self._fold(ctx, self._buffer, slot, update)
        self._counters.updates += 1
        if self._buffer.count >= self.params.num_updates_for_model:
            await self._new_version(ctx)

    async def _fold(self, ctx: WorkflowContext, buffer: UpdateBuffer, slot: _Slot, update: DXO) -> None:
        slot.taken = True
        self._folded[slot.version] += 1
        weight = weight_of(update) if self.params.update_weight == "num_examples" else 1.0
        minus = None
        if update.kind is DataKind.WEIGHTS:
            minus = await self._model_of(ctx, slot)
        elements = sum(a.size for a in update.data.values())
        if elements > THREAD_ELEMENTS:
            await asyncio.to_thread(
                buffer.add, slot.version, update.data, weight, minus=minus, meta=update.meta
            )
        else:
            buffer.add(slot.version, update.data, weight, minus=minus, meta=update.meta)

    async def _model_of(self, ctx: WorkflowContext, slot: _Slot) -> Mapping[str, NDArray[Any]]:
        """The model ``slot``'s task carried (a WEIGHTS update is folded as its difference to it)."""
        model = self._models.get(slot.version)
        if model is None:
            sha = slot.task.payload_sha256 or self._model_sha
            blobs = ctx.store.blobs

            async def load() -> Mapping[str, NDArray[Any]]:
                return DXO.from_bytes(await blobs.read(sha)).data

            model = self._models[slot.version] = LazyModel(model_spec(self._model), load)
        return await model.arrays()

    async def _new_version(self, ctx: WorkflowContext) -> None:
        """Makes the next global model from the buffer and checkpoints it with the selection.

        Tasks that fall out of the model history are closed first; a result the store accepted for one
        before that still counts, in this version.
        """
        sealed, self._buffer = self._buffer, UpdateBuffer(model_spec(self._model))
        version = self._version + 1
        history = self.params.max_model_history
        if history:
            old = [s for s in self._slots.values() if version - s.version >= history]
            accepted = await self._close_all(ctx, old, reason="stale")
            await self._take_completed(ctx, accepted, into=sealed)
        staleness = sealed.staleness(self._version)
        arrays = sealed.new_model(
            self._model,
            current=self._version,
            global_lr=self.params.global_lr,
            staleness_weight=self.params.staleness_weight,
        )
        count = sealed.count
        metrics: dict[str, float] = dict(sealed.metrics.result())
        del sealed
        metrics["num_updates"] = float(count)
        metrics["mean_staleness"] = sum(s * n for s, n in staleness.items()) / max(1, count)
        model = DXO(
            kind=DataKind.WEIGHTS, data=arrays, meta={MetaKey.MODEL_VERSION: version, "num_updates": count}
        )
        ref = await ctx.store.blobs.put_bytes(model.to_bytes())
        # Tasks done with are closed (their offers withdrawn), so that open tasks stay the selection's.
        done, self._done = self._done, []
        await ctx.store.close_tasks(done, fence=ctx.fence)
        live = sorted({s.version for s in self._slots.values()})
        self._folded = Counter({v: n for v, n in self._folded.items() if v in live})
        self._checkpoint_state = {
            "pending": list(self._slots),
            "counters": self._counters.as_dict(),
            # For the metrics, read from the store (progress_of): the versions with tasks out, and how
            # many of their tasks' updates the versions made so far consumed.
            "live_versions": live,
            "folded": {str(v): n for v, n in sorted(self._folded.items())},
        }
        payload = {
            "num_updates": count,
            "staleness": {str(s): n for s, n in staleness.items()},
            "metrics": dict(metrics),
            "selection": len(self._slots),
            "counters": self._counters.as_dict(),
        }
        event = _VersionEvent(version, payload, evaluating=self.params.evaluates(version))
        held = event.evaluating or bool(self._unpublished)  # events go out in version order
        if held:
            self._unpublished.append(event)
        self._metrics = metrics
        published: list[Event] = [] if held else [(MODEL_VERSION_EVENT, version, payload)]
        await self._save(ctx, version, ref.sha256, events=published)
        self._version, self._model, self._model_sha, self._on_version = version, arrays, ref.sha256, 0
        self._models = {v: m for v, m in self._models.items() if v in live}
        self._models[version] = LazyModel.of(arrays)
        log.info(
            "model version made",
            extra={"job_id": ctx.job.job_id, "model_version": version, "num_updates": count},
        )
        if event.evaluating:
            await self._evaluate(ctx, event)

    async def _save(
        self, ctx: WorkflowContext, version: int, model_sha: str, *, events: Sequence[Event] = ()
    ) -> None:
        """Checkpoints the latest version: its model, its metrics, and as state the checkpoint's with the
        events not published yet (written again, the same otherwise, when an evaluation ends), with the
        ``events`` published in the same transaction."""
        state = {**self._checkpoint_state, "unpublished": [e.as_state() for e in self._unpublished]}
        await ctx.save_checkpoint(
            version,
            model_sha,
            json.dumps(self._metrics, sort_keys=True),
            keep_last=max(1, self.params.keep_checkpoints),
            state_json=json.dumps(state, sort_keys=True),
            events=events,
        )

    # ---- evaluation ----
    def _evaluating(self) -> list[_Slot]:
        """The evaluation tasks not settled yet."""
        return [slot for event in self._unpublished for slot in event.out.values()]

    async def _evaluate(self, ctx: WorkflowContext, event: _VersionEvent) -> None:
        """Hands the version just made to ``eval_devices`` eligible devices outside the selection (and not
        evaluating already), sampled uniformly, seeded by (seed, version); with none, it ends at once.

        The devices are not kept from the selection's refills: evaluation never changes which devices
        train (one sampled for training meanwhile picks its ``train`` task up once it reported, the
        ``evaluate`` task being offered first).
        """
        candidates = self._candidates
        if not candidates.devices:
            await candidates.refresh(ctx, self._uses, self._busy, max_age=_ELIGIBLE_MAX_AGE_S)
        busy = {s.device for s in self._slots.values()} | {s.device for s in self._evaluating()}
        excluded = candidates.positions(busy)
        k = min(self.params.eval_devices, len(candidates.devices) - len(excluded))
        rng = np.random.default_rng([self.params.seed & 0xFFFFFFFF, event.version, 0, _EVAL_STREAM])
        chosen = candidates.pick(excluded, k, rng) if k > 0 else []
        if not chosen:
            log.warning(
                "no eligible device outside the selection to evaluate a model version",
                extra={"job_id": ctx.job.job_id, "model_version": event.version},
            )
            await self._end_evaluation(ctx, event)
            return
        tasks = await ctx.hand_out(
            EVALUATE_TASK,
            self._model_sha,
            chosen,
            round=event.version,
            due_in=timedelta(seconds=self.params.task_timeout_s),
            model_version=event.version,
        )
        event.tasks = [t.task_id for t in tasks]
        event.out = {t.task_id: _Slot(t, d) for t, d in zip(tasks, chosen, strict=True)}

    async def _settle_evaluations(
        self, ctx: WorkflowContext, slots: Sequence[_Slot], latest: Mapping[str, Assignment], now: datetime
    ) -> None:
        """Settles the evaluation tasks that were reported (a failure counts for nothing), lost, not
        picked up within ``pickup_timeout`` or not reported within ``task_timeout``; ends each
        evaluation with none left out and publishes what may go out."""
        pickup = timedelta(seconds=self.params.pickup_timeout_s)
        settled: set[str] = set()
        for slot in slots:
            assignment = latest.get(slot.task.task_id)
            if (
                (assignment is not None and assignment.state is not AssignmentState.LEASED)
                or now >= slot.task.deadline
                or (assignment is None and now >= slot.task.created_at + pickup)
            ):
                settled.add(slot.task.task_id)
            elif assignment is not None:
                slot.claimed = True
        for event in list(self._unpublished):
            for task_id in settled & event.out.keys():
                del event.out[task_id]
            if event.evaluating and not event.out:
                await self._end_evaluation(ctx, event)

    async def _end_evaluation(self, ctx: WorkflowContext, event: _VersionEvent) -> None:
        """Closes an evaluation (a later report is STALE) and adds the weighted mean of its successful
        results' metrics, prefixed ``eval_``, to its version's event (and, if that version is still the
        latest, to the checkpoint's metrics); then publishes the events that may go out."""
        await ctx.store.close_tasks(event.tasks, fence=ctx.fence)
        results = [
            r
            for task_id in event.tasks
            for r in await ctx.store.list_results(task_id=task_id)
            if r.status is ResultStatus.SUCCEEDED and r.accepted and r.payload_sha256
        ]
        metrics = await evaluation_metrics(results, ctx.store.blobs.read_each)
        event.payload["metrics"] = {**event.payload["metrics"], **metrics}
        event.evaluating, event.out = False, {}
        if event.version == self._version:
            self._metrics = {**self._metrics, **metrics}
        log.info(
            "model version evaluated",
            extra={"job_id": ctx.job.job_id, "model_version": event.version, "num_results": len(results)},
        )
        await self._publish(ctx)

    async def _publish(self, ctx: WorkflowContext) -> None:
        """Emits the held events, in version order, up to the first whose evaluation is still out, in a
        new write of the latest checkpoint that no longer holds them back (both or neither are kept)."""
        ready: list[_VersionEvent] = []
        while self._unpublished and not self._unpublished[0].evaluating:
            ready.append(self._unpublished.popleft())
        if not ready:
            return
        events = [(MODEL_VERSION_EVENT, e.version, e.payload) for e in ready]
        await self._save(ctx, self._version, self._model_sha, events=events)

    async def _finish_evaluations(self, ctx: WorkflowContext) -> None:
        """After the last version: closes the selection (its updates would count for nothing), then waits
        for the evaluations still out and publishes their versions."""
        if not self._unpublished:
            return
        await ctx.store.close_tasks([*self._slots, *self._done], fence=ctx.fence)
        self._slots.clear()
        self._done = []
        while self._unpublished:
            await self._look(ctx, [])
            due = self._next_due(ctx.clock.now())
            wait = self._poll if due is None else min(self._poll, (due - ctx.clock.now()).total_seconds())
            if self._unpublished:
                await ctx.progress.wait(max(0.0, wait))

    async def _restore_evaluations(
        self, ctx: WorkflowContext, saved: Iterable[Mapping[str, Any]], tasks: Sequence[Task]
    ) -> None:
        """Takes up the checkpoint's unpublished events: an evaluation still out goes on with the
        version's ``evaluate`` tasks in the store (handed out now if the crash came before they were:
        then the version is the latest); one with none left open ends now."""
        for item in saved:
            event = _VersionEvent(
                int(item["version"]), dict(item["payload"]), evaluating=bool(item["evaluating"])
            )
            self._unpublished.append(event)
            if not event.evaluating:
                continue
            mine = [t for t in tasks if t.name == EVALUATE_TASK and t.round == event.version]
            event.tasks = [t.task_id for t in mine]
            targets = await ctx.store.task_targets(task_ids=event.tasks)
            event.out = {
                t.task_id: _Slot(t, targets[t.task_id][0])
                for t in mine
                if t.state is TaskState.OPEN and targets.get(t.task_id)
            }
        for event in list(self._unpublished):
            if not event.evaluating or event.out:
                continue
            if not event.tasks and event.version == self._version:
                await self._evaluate(ctx, event)
            else:
                await self._end_evaluation(ctx, event)

    # ---- the selection ----
    def _free(self, slot: _Slot) -> None:
        if self._slots.pop(slot.task.task_id, None) is not None:
            self._done.append(slot.task.task_id)
            self._candidates.freed(slot.device, self._uses[slot.device])

    def _busy(self) -> list[str]:
        """The devices holding a task of the selection."""
        return [s.device for s in self._slots.values()]

    async def _refill(self, ctx: WorkflowContext) -> None:
        """Hands the current model to sampled devices once ``min_hole_to_fill`` slots are free.

        The first fill waits for enough devices to fill the whole selection (as FLARE's does); later
        ones take what there is. While the selection cannot be filled, the device wait runs.
        """
        params = self.params
        holes = params.device_selection_size - len(self._slots)
        if holes < params.min_hole_to_fill:
            return
        candidates = self._candidates
        await candidates.refresh(ctx, self._uses, self._busy, max_age=_ELIGIBLE_MAX_AGE_S)
        usable = candidates.usable(reuse=params.device_reuse)
        if usable < holes:  # devices may have come since the list was read
            await candidates.refresh(ctx, self._uses, self._busy, max_age=_ELIGIBLE_SHORT_AGE_S)
            usable = candidates.usable(reuse=params.device_reuse)
        self._usable = usable
        if usable < holes:
            if self._short_since is None:
                self._short_since = ctx.clock.now()
            if self._counters.handed_out == 0 or not usable:
                return
        chosen = self._sample(min(holes, usable))
        tasks = await ctx.hand_out(
            TRAIN_TASK,
            self._model_sha,
            chosen,
            round=self._version,
            due_in=timedelta(seconds=params.task_timeout_s),
            model_version=self._version,
        )
        for task, device in zip(tasks, chosen, strict=True):
            self._slots[task.task_id] = _Slot(task, device)
            candidates.taken(device, self._uses[device])
            self._uses[device] += 1
        self._on_version += len(tasks)
        self._counters.handed_out += len(tasks)
        if len(self._slots) >= params.device_selection_size:
            self._short_since = None

    def _sample(self, k: int) -> list[str]:
        """``k`` eligible devices outside the selection, seeded by (seed, version + 1, tasks handed out
        on this version), in id order.

        ``random`` picks uniformly (without ``device_reuse``, among the devices never used);
        ``balanced`` takes the least used devices first, uniformly among equals. Either costs
        O(k + the selection's size), never O(eligible devices) (see
        :class:`~fedlink.server.workflows.device_pool.DevicePool`).
        """
        version, wave = self._version + 1, self._on_version
        rng = np.random.default_rng([self.params.seed & 0xFFFFFFFF, version, wave])
        return self._candidates.sample(
            k,
            balanced=self.params.device_sampling_strategy == "balanced",
            reuse=self.params.device_reuse,
            rng=rng,
        )

    def _check_wait(self, now: datetime) -> None:
        """Fails the run once the selection could not be filled for ``device_wait_timeout``."""
        timeout = self.params.device_wait_timeout_s
        if self._short_since is None or not timeout:
            return
        if now - self._short_since >= timedelta(seconds=timeout):
            unused = "" if self.params.device_reuse else " that had no task of the job yet"
            raise FailedPrecondition(
                f"fedbuff: the selection of {self.params.device_selection_size} devices was not full for "
                f"device_wait_timeout ({timeout:g}s): {len(self._slots)} devices hold a task, and "
                f"{self._usable} other eligible online devices{unused} could take one"
            )


# ---- what the store says of a run ------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class FedBuffProgress:
    """Where a FedBuff run stands, as the store has it: the same on every coordinator replica."""

    #: The latest model version (0: the job's initial model).
    version: int
    #: Updates the store accepted that no version consumed yet.
    buffered: int
    #: Devices holding a task of the selection (handed out, neither reported nor lost).
    selection_filled: int


async def progress_of(store: StateStore, run: Run) -> FedBuffProgress:
    """Reads a FedBuff run's progress from its latest checkpoint and one count per version with tasks
    out (usually at most ``max_model_history``): no walk of devices, tasks or results.

    The checkpoint names the versions with tasks out (every other version's tasks are closed) and how
    many of their updates the versions made so far consumed; the store counts each version's accepted
    updates and open tasks owing a report (``round_summary``). A checkpoint written by a release before
    these keys counts the latest version only.
    """
    state = _json_object(run.workflow_state_json)
    versions = {run.round, *(int(v) for v in state.get("live_versions", ()))}
    folded = {int(v): int(n) for v, n in dict(state.get("folded", {})).items()}
    buffered = holding = 0
    for version in sorted(versions):
        summary = await store.round_summary(run_id=run.run_id, round=version, name=TRAIN_TASK)
        buffered += summary.succeeded - folded.get(version, 0)
        holding += summary.owing
    return FedBuffProgress(version=run.round, buffered=max(0, buffered), selection_filled=holding)


def _json_object(text: str | None) -> dict[str, Any]:
    """A JSON object the workflow wrote (``{}`` for anything else: no checkpoint yet is ``[]``)."""
    value = json.loads(text or "{}")
    return value if isinstance(value, dict) else {}


__all__ = ["MODEL_VERSION_EVENT", "Arrivals", "FedBuff", "FedBuffParams", "FedBuffProgress", "progress_of"]
