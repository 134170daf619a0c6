"""FedAvg: synchronous rounds of seeded device samples and weighted averaging.

Each round hands one ``train`` task per sampled device (a task targeted at that device, one slot), so
every device's share of the round is its own row: an expired lease or a failed result frees exactly
that device's part, and a replacement is sampled from the devices not yet asked. A round closes once
``min_results`` results are in and no sampled device still owes one, or at the deadline. The round's
state lives in the store (tasks, assignments, results), so a restarted coordinator resumes it as it
was: acknowledged results count once, and no device is asked to redo a task it reported.

Aggregation folds the round's accepted results one at a time, in the canonical order (their tasks'
hand-out order, then device id), into float64 accumulators: memory grows with the model, not with the
results, and the same results give the same bits. The fold starts while the round is open, from the
updates the report path hands over in-process (:mod:`fedlink.server.workflows.folding`); what it could
not fold yet is read from the store at the close, small result blobs in bulk, a batch of a few
megabytes per query, the next batch while this one is folded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, Protocol

import numpy as np
from numpy.typing import NDArray

from fedlink.common.dxo import DXO, DataKind, MetaKey
from fedlink.common.errors import FailedPrecondition, InvalidArgument
from fedlink.server.coordination.model_outlines import read_blob_outline, spec_of
from fedlink.server.coordination.progress import UpdateSink
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
    selector_matches,
    summarize_failures,
)
from fedlink.server.store import NewTask
from fedlink.server.workflows.aggregation import Aggregate
from fedlink.server.workflows.base import WorkflowContext
from fedlink.server.workflows.folding import (
    LazyModel,
    MetricAverage,
    ReportedElsewhere,
    RoundFold,
    canonical_order,
    evaluation_metrics,
)
from fedlink.server.workflows.optimizers import AddAggregate, OptimizerState, ServerStep
from fedlink.server.workflows.params import WorkflowParams, seconds_field

log = logging.getLogger(__name__)

#: A round owing at most this many results is checked at every progress signal (no throttling):
#: the last result then closes the round at once, for a bounded number of extra store reads.
_EAGER_OWING = 8
_LOST = frozenset({AssignmentState.EXPIRED, AssignmentState.RELEASED, AssignmentState.FAILED})
#: Updates a round's in-process fold may hold before their turn comes (see RoundFold).
_FOLD_AHEAD_BYTES = 256 * 1024**2


async def save_state(ctx: WorkflowContext, state: OptimizerState) -> tuple[str, str | None]:
    """A server step's state as the checkpoint keeps it: JSON values, and its arrays as a blob."""
    values = json.dumps(dict(state.values), sort_keys=True)
    if not state.arrays:
        return values, None
    ref = await ctx.store.blobs.put_bytes(DXO(kind=DataKind.APP_DEFINED, data=dict(state.arrays)).to_bytes())
    return values, ref.sha256


async def load_state(ctx: WorkflowContext, run: Run) -> OptimizerState:
    """The server step's state at the run's last checkpoint (empty before the first)."""
    values = json.loads(run.workflow_state_json or "{}")
    if run.workflow_state_sha256 is None:
        return OptimizerState(values=values)
    arrays = DXO.from_bytes(await ctx.store.blobs.read(run.workflow_state_sha256)).data
    return OptimizerState(values=values, arrays=arrays)


class RoundFailed(FailedPrecondition):
    """A round ended with too few results and may not be retried."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FedAvgParams(WorkflowParams):
    """FedAvg's parameters (the proto's FedAvgConfig): the synchronous rounds every round-based
    strategy shares."""

    exclusive_keys = (("fraction", "devices_per_round"),)

    #: Rounds to run.
    num_rounds: int
    #: Fraction of eligible devices sampled per round (used when ``devices_per_round`` is 0).
    fraction: float = 1.0
    #: Devices sampled per round; 0 means use ``fraction``.
    devices_per_round: int = 0
    #: Results needed to close a round; 0 means every sampled device.
    min_results: int = 0
    #: How long a round stays open.
    round_timeout_s: float = seconds_field(600.0)
    #: How long a sampled device has to pick up its task before it is offered to another device.
    pickup_timeout_s: float = seconds_field(30.0)
    #: Eligible online devices needed before the first round; 0 means ``min_results`` (at least 1).
    min_devices: int = 0
    #: Seed of the sampling generator.
    seed: int = 0
    #: Send an ``evaluate`` task with the new model to the round's devices after aggregation.
    evaluate: bool = False
    #: What to do when a round got too few results: hand it out again, or fail the job.
    round_failure_policy: Literal["retry", "fail"] = "retry"
    #: How many times a round may be retried.
    max_round_retries: int = 2
    #: Round checkpoints kept besides the final model.
    keep_checkpoints: int = 3

    def __post_init__(self) -> None:
        if self.num_rounds < 1:
            raise InvalidArgument("num_rounds must be at least 1")
        if not 0 < self.fraction <= 1:
            raise InvalidArgument("fraction must be in (0, 1]")
        for name in (
            "devices_per_round",
            "min_results",
            "min_devices",
            "max_round_retries",
            "keep_checkpoints",
        ):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must not be negative")
        if self.devices_per_round and self.min_results > self.devices_per_round:
            raise InvalidArgument("min_results cannot exceed devices_per_round")
        if not (math.isfinite(self.round_timeout_s) and self.round_timeout_s > 0):
            raise InvalidArgument("round_timeout must be positive")
        if not (math.isfinite(self.pickup_timeout_s) and self.pickup_timeout_s > 0):
            raise InvalidArgument("pickup_timeout must be positive")
        if self.round_failure_policy not in ("retry", "fail"):
            raise InvalidArgument("round_failure_policy must be 'retry' or 'fail'")

    @property
    def num_steps(self) -> int:
        """The rounds to run."""
        return self.num_rounds

    @property
    def task_names(self) -> tuple[str, ...]:
        """``train``, and ``evaluate`` when the rounds are evaluated."""
        return (TRAIN_TASK, EVALUATE_TASK) if self.evaluate else (TRAIN_TASK,)

    def time_bound_s(self) -> float:
        """Every round (and its evaluation) open to its timeout, with every retry."""
        per_round = self.round_timeout_s * (self.max_round_retries + 1) * (2 if self.evaluate else 1)
        return self.num_rounds * per_round

    def round_rule(self) -> RoundRule:
        """How a round's updates become its aggregate: the weighted mean, folded as they arrive."""
        return streaming_mean

    def server_step(self) -> ServerStep:
        """How the aggregate becomes the next model: added to it."""
        return AddAggregate()

    def sample_size(self, eligible: int) -> int:
        """How many devices to sample from ``eligible`` ones."""
        if self.devices_per_round:
            return min(self.devices_per_round, eligible)
        return max(1, min(eligible, math.ceil(self.fraction * eligible)))

    def needed(self, sampled: int) -> int:
        """Results needed to close a round of ``sampled`` devices."""
        return self.min_results or sampled


def sample_devices(candidates: Sequence[str], k: int, *, seed: int, round: int, wave: int) -> list[str]:
    """Picks ``k`` of ``candidates``, seeded by (seed, round, wave): same inputs, same picks."""
    ordered = sorted(candidates)
    if k >= len(ordered):
        return ordered
    rng = np.random.default_rng([seed & 0xFFFFFFFF, round, wave])
    picks = rng.choice(len(ordered), size=k, replace=False)
    return [ordered[i] for i in sorted(picks)]


@dataclass(slots=True)
class _RoundView:
    """One round's tasks as the store has them, by purpose."""

    tasks: list[Task]
    assignments: dict[str, Assignment]
    results: dict[str, Result]
    targets: dict[str, tuple[str, ...]]

    def asked(self) -> set[str]:
        """Devices this round's tasks were offered to."""
        return {d for devices in self.targets.values() for d in devices}

    def open(self) -> list[Task]:
        return [t for t in self.tasks if t.state is TaskState.OPEN]

    def succeeded(self) -> list[Result]:
        return [r for r in self.results.values() if r.status is ResultStatus.SUCCEEDED and r.accepted]

    def lost(self, task: Task, *, unclaimed_before: datetime | None = None) -> bool:
        """True if the task's device will not deliver: its lease expired, it released or failed it,
        or (given ``unclaimed_before``) it did not claim a task created before then."""
        a = self.assignments.get(task.task_id)
        if a is None:
            late = unclaimed_before is not None and task.created_at <= unclaimed_before
            return late and task.task_id not in self.results
        return a.state in _LOST

    def owing(self) -> list[Task]:
        """Open tasks whose device may still report."""
        done = {r.task_id for r in self.results.values()}
        return [t for t in self.open() if t.task_id not in done and not self.lost(t)]


class RoundUpdates(UpdateSink, Protocol):
    """A round's accepted updates on their way to its aggregate: taken in-process as they are
    reported (an :class:`UpdateSink`), completed from the store at the close."""

    #: The round's global model.
    model: LazyModel
    #: The results' metrics, averaged.
    metrics: MetricAverage

    @property
    def count(self) -> int:
        """How many results the aggregate holds (once finished)."""
        ...

    def expect(self, tasks: Sequence[Task], devices: Sequence[str]) -> None:
        """Adds train tasks handed out (``devices[i]`` the target of ``tasks[i]``)."""
        ...

    async def finish_if_all_folded(self, succeeded: int) -> bool:
        """Ends the closed round if every one of its ``succeeded`` accepted results is taken already."""
        ...

    async def finish(
        self, results: Sequence[Result], read_each: Callable[[Sequence[str]], AsyncIterator[bytes]]
    ) -> None:
        """Takes the closed round's accepted ``results`` (in canonical order) not taken yet."""
        ...

    def devices(self) -> list[str]:
        """The devices whose results the aggregate holds."""
        ...

    def aggregate(self) -> Aggregate:
        """The round's aggregate update (once finished)."""
        ...


#: Opens a round: its updates' holder, given the round's model.
RoundRule = Callable[[LazyModel], RoundUpdates]


def streaming_mean(model: LazyModel) -> RoundUpdates:
    """FedAvg's round rule: the weighted mean, folded as results arrive (:class:`RoundFold`)."""
    return RoundFold(model, budget_bytes=_FOLD_AHEAD_BYTES)


class FedAvg:
    """The FedAvg workflow, and the round driver of every strategy built on its rounds.

    The parameters say how a round's updates become its aggregate (:meth:`FedAvgParams.round_rule`:
    the streaming weighted mean, or a robust rule) and how the aggregate becomes the next model
    (:meth:`FedAvgParams.server_step`: added, or a server optimizer's step, whose state is checkpointed
    with the model).
    """

    def __init__(
        self,
        params: FedAvgParams,
        *,
        poll_seconds: float = 1.0,
        min_check_seconds: float | None = None,
    ) -> None:
        self.params = params
        self._rule = params.round_rule()
        self._server = params.server_step()
        #: The open round's updates, while its train tasks are out.
        self._open: RoundUpdates | None = None
        self._poll = poll_seconds
        if min_check_seconds is None:
            min_check_seconds = 0.05
        self._min_check = min(min_check_seconds, poll_seconds)
        #: The longest a round owing many results goes unread while progress signals come. Every
        #: in-process change signals (results, releases; expiries and job changes urgently): this only
        #: bounds how late a change this process is not told about (another replica's) is seen.
        self._max_unread = max(10 * min_check_seconds, poll_seconds)
        #: Not before then is the round looked at again for unclaimed tasks: the last look found late
        #: ones but no device to give them to (they stay with their device, which may still come).
        self._pickup_recheck: datetime | None = None

    async def run(self, ctx: WorkflowContext) -> None:
        """Runs rounds from the run's last checkpoint to ``num_rounds``."""
        run = ctx.run
        model_sha = run.global_model_sha256 or ctx.job.initial_model_sha256
        if model_sha is None:
            raise InvalidArgument("the job has no initial model")
        model: DXO | None = None  # read from the store for the first round; then the one just made
        self._server.restore(await load_state(ctx, run))
        for round_no in range(run.round + 1, self.params.num_rounds + 1):
            # Only the first round may be resumed; the later ones start here, with no tasks yet.
            fresh = round_no > run.round + 1
            model_sha, model = await self._round(ctx, round_no, model_sha, model, fresh=fresh)

    # ---- one round ----
    async def _round(
        self, ctx: WorkflowContext, round_no: int, model_sha: str, model: DXO | None, *, fresh: bool
    ) -> tuple[str, DXO]:
        """Runs one round on the global model ``model_sha`` (``model``, if the caller has it decoded);
        returns the new global model, stored and decoded."""
        updates = self._rule(await self._global_model(ctx, model_sha, model))
        # Results recorded by other replicas sharing the store are read as they are relayed.
        elsewhere = ReportedElsewhere(
            updates,
            results_of=lambda task_ids: ctx.store.list_results(task_ids=task_ids),
            read_each=ctx.store.blobs.read_each,
        )
        ctx.progress.sink, self._open = updates, updates
        ctx.progress.on_reported_elsewhere = elsewhere.add
        try:
            await self._collect(ctx, round_no, TRAIN_TASK, model_sha, fresh=fresh)
            ctx.progress.on_reported_elsewhere = None
            await elsewhere.stop()
            # The round is closed: no result can be added. If the updates taken in-process are every
            # accepted result the store counts, the results need not be read back.
            closed = await ctx.store.round_summary(run_id=ctx.run.run_id, round=round_no, name=TRAIN_TASK)
            if not await updates.finish_if_all_folded(closed.succeeded):
                results = await self._succeeded(ctx, round_no, TRAIN_TASK)
                await updates.finish(results, ctx.store.blobs.read_each)
        finally:
            elsewhere.cancel()
            ctx.progress.sink, self._open, ctx.progress.on_reported_elsewhere = None, None, None
        count, metrics, devices = updates.count, dict(updates.metrics.result()), sorted(updates.devices())
        new_model = DXO(
            kind=DataKind.WEIGHTS,
            data=self._server.apply(await updates.model.arrays(), updates.aggregate(), round_no=round_no),
            # The version a trainer sees next round: it seeds the shuffling, so rounds differ.
            meta={MetaKey.MODEL_VERSION: round_no, "round_results": count},
        )
        # The aggregate (the float64 sums, twice the model, or a robust rule's updates) and the round's
        # model go before the new one is serialized (two more copies of it).
        del updates
        new_ref = await ctx.store.blobs.put_bytes(new_model.to_bytes())
        if self.params.evaluate:
            await self._collect(ctx, round_no, EVALUATE_TASK, new_ref.sha256, devices=devices)
            evaluation = await self._succeeded(ctx, round_no, EVALUATE_TASK)
            metrics.update(await evaluation_metrics(evaluation, ctx.store.blobs.read_each))
        metrics_json = json.dumps(metrics, sort_keys=True)
        state_json, state_sha = await save_state(ctx, self._server.state())
        await ctx.save_checkpoint(
            round_no,
            new_ref.sha256,
            metrics_json,
            # The final model is the last checkpoint: "keep none besides it" keeps that one.
            keep_last=max(1, self.params.keep_checkpoints),
            state_json=state_json,
            state_sha256=state_sha,
            events=[("round_closed", round_no, {"num_results": count, "metrics": metrics})],
        )
        log.info("round closed", extra={"job_id": ctx.job.job_id, "round": round_no, **metrics})
        return new_ref.sha256, new_model

    @staticmethod
    async def _global_model(ctx: WorkflowContext, model_sha: str, model: DXO | None) -> LazyModel:
        """The round's model: the one just made, or the stored one, read only once it is needed (a
        model of a GiB decoded up front sat in memory while the devices downloaded it)."""
        if model is not None:
            return LazyModel.of(model.data)

        async def load() -> Mapping[str, NDArray[Any]]:
            return DXO.from_bytes(await ctx.store.blobs.read(model_sha)).data

        # Read in this task (no shared, detached read): a driver cancelled meanwhile leaves nothing behind.
        return LazyModel(spec_of(await read_blob_outline(ctx.store.blobs, model_sha)), load)

    async def _succeeded(self, ctx: WorkflowContext, round_no: int, name: str) -> list[Result]:
        """The closed round's results to aggregate, in canonical order (as :meth:`_view` has them,
        without its other reads)."""
        run_id = ctx.run.run_id
        all_tasks, all_results = await asyncio.gather(
            ctx.store.list_tasks(run_id, round=round_no),
            ctx.store.list_results(run_id=run_id, round=round_no, accepted_only=False),
        )
        named = {t.task_id: t for t in all_tasks if t.name == name}
        by_task = {r.task_id: r for r in all_results if r.task_id in named and not r.stale}
        succeeded = [r for r in by_task.values() if r.status is ResultStatus.SUCCEEDED and r.accepted]
        return canonical_order(succeeded, named)

    async def _view(self, ctx: WorkflowContext, round_no: int, name: str) -> _RoundView:
        # Independent reads go together: the round's close waits for two round trips, not four.
        run_id = ctx.run.run_id
        all_tasks, all_results = await asyncio.gather(
            ctx.store.list_tasks(run_id, round=round_no),
            ctx.store.list_results(run_id=run_id, round=round_no, accepted_only=False),
        )
        tasks = [t for t in all_tasks if t.name == name]
        ids = [t.task_id for t in tasks]
        listed, targets = await asyncio.gather(
            ctx.store.list_assignments(task_ids=ids), ctx.store.task_targets(task_ids=ids)
        )
        assignments = {a.task_id: a for a in listed}
        wanted = set(ids)
        results = {r.task_id: r for r in all_results if r.task_id in wanted and not r.stale}
        return _RoundView(tasks, assignments, results, targets)

    async def _collect(
        self,
        ctx: WorkflowContext,
        round_no: int,
        name: str,
        payload_sha: str,
        *,
        devices: Sequence[str] | None = None,
        fresh: bool = False,
    ) -> None:
        """Hands out ``name`` tasks for the round, waits until the round can close, and closes it.

        Returns once the round has enough results (``_succeeded`` lists them). With ``devices`` the
        tasks go to exactly those devices (evaluation) and whatever arrives by the deadline counts.
        Resumable: tasks already in the store for this round are picked up as they are, unless
        ``fresh`` says this driver knows there are none.
        """
        run_id = ctx.run.run_id
        # Counted in the store: a restarted coordinator resumes a round with the retries it had taken.
        retries = 0 if fresh else await ctx.store.round_retries(run_id=run_id, round=round_no, name=name)
        self._pickup_recheck = None
        if fresh:
            await self._start_wave(ctx, round_no, name, payload_sha, None, devices, wave=0)
        while True:
            seen = ctx.progress.signals
            ctx.progress.urgent = False
            summary = await ctx.store.round_summary(run_id=run_id, round=round_no, name=name)
            if summary.tasks == 0:
                await self._start_wave(ctx, round_no, name, payload_sha, None, devices, wave=0)
                continue
            needed = self.params.needed(summary.first_wave) if devices is None else 0
            if summary.open:
                now = ctx.clock.now()
                deadline = summary.next_deadline or now
                short = summary.succeeded < needed
                # A sampled device that has not picked up its task within the pickup timeout is
                # replaced like one whose lease ran out, not waited for until the round's timeout.
                pickup = timedelta(seconds=self.params.pickup_timeout_s)
                unclaimed = summary.oldest_unclaimed
                pickup_due = unclaimed + pickup if unclaimed is not None and devices is None else None
                if pickup_due is not None and self._pickup_recheck is not None:
                    pickup_due = max(pickup_due, self._pickup_recheck)
                late = pickup_due is not None and pickup_due <= now
                if short and (summary.lost_open or late) and now < deadline and devices is None:
                    view = await self._view(ctx, round_no, name)
                    if await self._replace_lost(
                        ctx, round_no, name, payload_sha, view, deadline, unclaimed_before=now - pickup
                    ):
                        continue
                if now >= deadline or summary.owing == 0:
                    await ctx.store.close_round_tasks(
                        run_id=run_id, round=round_no, name=name, fence=ctx.fence
                    )
                    if summary.succeeded >= needed:  # results only add up: no need to count again
                        return
                    continue
                wake = min(deadline, pickup_due) if short and pickup_due is not None else deadline
                await self._pause(ctx, (wake - now).total_seconds(), owing=summary.owing, seen=seen)
                continue
            if summary.succeeded >= needed:
                return
            shortfall = await _shortfall(ctx, run_id, round_no, name, got=summary.succeeded, needed=needed)
            if self.params.round_failure_policy == "fail":
                raise RoundFailed(shortfall)
            # Counted before its wave is handed out: a crash in between spends a retry, never adds one.
            retries = await ctx.store.count_round_retry(
                run_id=run_id, round=round_no, name=name, fence=ctx.fence
            )
            if retries > self.params.max_round_retries:
                raise RoundFailed(shortfall)
            log.warning(
                f"{shortfall}; retrying",
                extra={"job_id": ctx.job.job_id, "round": round_no, "retry": retries},
            )
            view = await self._view(ctx, round_no, name)
            await self._start_wave(ctx, round_no, name, payload_sha, view, devices, wave=retries)

    async def _pause(self, ctx: WorkflowContext, until_deadline: float, *, owing: int, seen: int) -> None:
        """Waits until the round may have changed enough to be worth reading again.

        Results arrive one by one; waking on each would re-read the round per result. A round that
        owes only a few results is read again at each progress signal, so its last result closes it
        at once. A round that owes more is read again once as many signals came (since ``seen``, the
        count when it was last read) as it owes results — every recorded report and release signals
        once, so its last result still closes it at once — or at an urgent signal (leases that ran
        out, a job change), or after the larger of ``poll_seconds`` and ten times
        ``min_check_seconds`` (for what another replica changed), and never sooner than
        ``min_check_seconds`` (at most ``poll_seconds``) after the last read.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        if owing <= _EAGER_OWING:
            await ctx.progress.wait(min(self._poll, max(0.0, until_deadline)))
            return
        limit = min(self._max_unread, max(0.0, until_deadline))
        while ctx.progress.signals - seen < owing and not ctx.progress.urgent:
            left = limit - (loop.time() - started)
            if left <= 0:
                break
            await ctx.progress.wait(left)
        rest = self._min_check - (loop.time() - started)
        if rest > 0:
            await asyncio.sleep(min(rest, max(0.0, until_deadline)))

    def _wave_size(self, view: _RoundView) -> int:
        first = min(t.created_at for t in view.tasks)
        return sum(1 for t in view.tasks if t.created_at == first)

    async def _eligible(self, ctx: WorkflowContext) -> list[str]:
        selector = ctx.job.device_selector
        # Only devices that asked for this job's kind of work: one that enrolled and went silent, or
        # that runs other jobs only, would hold the round until its pickup timeout.
        online = await ctx.store.online_devices(with_info=bool(selector), job_name=ctx.job.name)
        return [device_id for device_id, info in online if selector_matches(selector, info)]

    async def _start_wave(
        self,
        ctx: WorkflowContext,
        round_no: int,
        name: str,
        payload_sha: str,
        view: _RoundView | None,
        devices: Sequence[str] | None,
        *,
        wave: int,
    ) -> None:
        """Samples devices for the round (wave 0) or for a retry of it, and hands out their tasks."""
        if devices is not None:
            chosen = list(devices)
        elif wave == 0:
            minimum = max(1, self.params.min_devices or self.params.min_results)
            candidates = await self._eligible(ctx)
            while len(candidates) < minimum:  # the job waits for enough devices to start
                await ctx.progress.wait(self._poll)
                candidates = await self._eligible(ctx)
            k = self.params.sample_size(len(candidates))
            chosen = sample_devices(candidates, k, seed=self.params.seed, round=round_no, wave=0)
        else:
            # A retry asks again, among everyone who has not delivered a result this round.
            delivered = {r.device_id for r in view.succeeded()} if view is not None else set()
            candidates = [d for d in await self._eligible(ctx) if d not in delivered]
            if not candidates:
                raise RoundFailed(f"round {round_no} is short of results and no other device is online")
            k = min(len(candidates), self._wave_size(view) if view is not None else len(candidates))
            chosen = sample_devices(candidates, k, seed=self.params.seed, round=round_no, wave=wave)
        deadline = ctx.clock.now() + timedelta(seconds=self.params.round_timeout_s)
        await self._hand_out(ctx, round_no, name, payload_sha, chosen, deadline)
        if name == TRAIN_TASK and wave == 0:
            await ctx.emit("round_started", round_no, {"num_devices": len(chosen)})

    async def _hand_out(
        self,
        ctx: WorkflowContext,
        round_no: int,
        name: str,
        payload_sha: str,
        devices: Sequence[str],
        deadline: datetime,
    ) -> None:
        if not devices:
            return
        created = await ctx.store.create_tasks(
            [
                NewTask(
                    job_id=ctx.job.job_id,
                    run_id=ctx.run.run_id,
                    round=round_no,
                    name=name,
                    payload_sha256=payload_sha,
                    deadline=deadline,
                    slots=1,
                    targets=(device,),
                    # Training starts from the last round's model; evaluation sees this round's.
                    model_version=round_no - 1 if name == TRAIN_TASK else round_no,
                )
                for device in devices
            ],
            fence=ctx.fence,
        )
        if name == TRAIN_TASK and self._open is not None:
            self._open.expect(created, devices)
        ctx.known_tasks.add(created)  # the devices' claims are answered without reading them back
        ctx.notifier.notify(ctx.job.job_id, devices)

    async def _replace_lost(
        self,
        ctx: WorkflowContext,
        round_no: int,
        name: str,
        payload_sha: str,
        view: _RoundView,
        deadline: datetime,
        *,
        unclaimed_before: datetime,
    ) -> bool:
        """Closes open tasks whose device was lost and offers each to a device not asked this round;
        likewise tasks not claimed by ``unclaimed_before``, as far as there are devices to ask.

        An unclaimed task with nobody to replace its device stays open: its device may still come (at
        100,000 simulated devices the last ones claim more than a pickup timeout after the round's
        start), and closing it would leave the round short until its deadline.
        """
        dead = [t for t in view.open() if view.lost(t)]
        late = [
            t for t in view.open() if not view.lost(t) and view.lost(t, unclaimed_before=unclaimed_before)
        ]
        if not dead and not late:
            return False
        asked = view.asked()
        candidates = [d for d in await self._eligible(ctx) if d not in asked]
        spare = max(0, len(candidates) - len(dead))
        if late and spare < len(late):
            self._pickup_recheck = ctx.clock.now() + timedelta(seconds=self.params.pickup_timeout_s)
        closing = dead + late[:spare]
        if not closing:
            return False
        chosen = sample_devices(
            candidates,
            min(len(closing), len(candidates)),
            seed=self.params.seed,
            round=round_no,
            wave=len(view.tasks),
        )
        for task in closing:
            await ctx.store.close_task(task.task_id, fence=ctx.fence)
        await self._hand_out(ctx, round_no, name, payload_sha, chosen, deadline)
        return True


async def _shortfall(
    ctx: WorkflowContext, run_id: str, round_no: int, name: str, *, got: int, needed: int
) -> str:
    """Why a round fell short, in one line: the count, and its devices' most common failure reasons."""
    reasons = [
        r.error_message
        for r in await ctx.store.result_outlines(run_id)
        if r.round == round_no and r.task_name == name and r.status is ResultStatus.FAILED
    ]
    failed = summarize_failures(reasons)
    return f"round {round_no} got {got} of the {needed} results it needs" + (f"; {failed}" if failed else "")
