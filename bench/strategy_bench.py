"""Strategy benchmark: server optimizers against FedAvg, and the robust rules against plain numpy.

Run from the repository root::

    .venv/bin/python -m bench.strategy_bench [--quick] [--json out.json] [--devices 100]
        [--floats 1000000] [--repeats 5] [--krum-f 10]

The workload: one float32 variable of ``--floats`` elements, ``--devices`` updates. Device i's update
is ``N(0, s_i^2)`` with ``s_i = 0.01 * (1 + i / devices)`` (distinct, so Krum's choice is clear-cut), and
the last ``krum_f`` devices send updates 20 times larger (the attackers a robust rule resists); its
weight is ``num_examples = i + 1``. The updates reach fedlink as the report path hands them to the round
holder: WEIGHT_DIFF DXOs decoded from their wire bytes (read-only views of the bytes protobuf gives),
offered, settled as accepted, then the round closes and the strategy's server step makes the new model.

(a) FedAvgM (server momentum 0.9) and FedAdam (Flower's defaults) against FedAvg: one round's
aggregation, the fold of every update (offer, settle, absorbed; :class:`RoundFold`) plus the server
step, timed in this process. Each strategy keeps its server step (and its state) from round to round,
after one untimed warm-up round; the strategies take turns round by round, in a rotating order,
because the machine is shared and noisy. The figures are medians over ``--repeats`` rounds; the
target is a FedAvgM and a FedAdam round within 1.5x of a FedAvg round. FedAvg's warm-up model is
checked against numpy's weighted mean.

(b) The coordinate-wise median, the trimmed mean (beta 0.2) and Krum (``krum_f`` malicious, one chosen)
against a plain numpy implementation of the same rule: ``np.stack`` of the updates, then
``np.median(axis=0)``; a sort-and-slice trimmed mean; Flower-style Krum with the distances from the Gram
matrix and the weighted mean of the chosen. Every run is a fresh child process that makes its own updates
and times one round from "every update held" to "the new model made" (fedlink: the close, which brings
the round's rows in place, and the server step; numpy: stack, rule, model + aggregate). fedlink copies
each accepted update into the round's rows as it arrives, while the round waits for the others; that time
(each update's offer, settle and copy) is printed beside the table, not in it. The children are forked
from a fork server that only imported the modules (multiprocessing's ``forkserver``, not ``spawn``: a
spawned child's ``ru_maxrss`` starts at this process's peak, which part (a) takes above a round's size).
A child's peak memory is its peak RSS (``getrusage(RUSAGE_SELF).ru_maxrss``, read right after the round)
minus its RSS (``VmRSS``) just before the first update was made, so it counts the updates held, whatever
the round needs besides, and the new model: the same measure on both sides. That peak also counts the
making of the updates (the bench's devices: each update's array and its wire bytes, freed but kept by the
allocator); the close peak (Linux's ``VmHWM``, reset through ``/proc/self/clear_refs`` once every update
is held, minus the same starting RSS) counts what the round holds and needs from then on, and is the one
judged. The sides alternate in every repeat and the rules take turns; times are medians, peaks the
largest of the repeats. The targets: fedlink no slower than numpy, and its close peak no more than the
updates held plus one model (``devices + 1`` model sizes; judged only for a model of at least 1 MiB,
below which the interpreter's own RSS noise is larger than a model). Every run's aggregate and new model
are checked against numpy's within float32 rounding: the bench stops with an error (exit 1) if one is
not.

When the memory is judged, each rule's fedlink side runs once more with glibc's mmap threshold fixed
(``mallopt(M_MMAP_THRESHOLD)``, as ``MALLOC_MMAP_THRESHOLD_`` sets it), so that the memory of each
update freed goes back to the kernel at once: that figure (not judged) tells what the round holds from
what the allocator keeps.

``--quick`` (what the test suite runs): 8 devices x 20,000 floats, one repeat.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import gc
import json
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from bench.orphans import die_with_multiprocessing_parent
from bench.proc_stats import memory_use
from bench.report import targets_line
from fedlink.common.dxo import DXO, DataKind, MetaKey
from fedlink.server.domain import Task, TaskState
from fedlink.server.workflows.fedavg import FedAvgParams, RoundUpdates
from fedlink.server.workflows.folding import LazyModel
from fedlink.server.workflows.optimizers import ServerStep
from fedlink.server.workflows.robust import FedMedianParams, FedTrimmedAvgParams, KrumParams, RobustParams
from fedlink.server.workflows.strategies import FedAdamParams, FedAvgMParams

#: What the fork server imports for its children (this module's imports).
PRELOAD = (
    "numpy",
    "bench.proc_stats",
    "fedlink.common.dxo",
    "fedlink.server.domain",
    "fedlink.server.workflows.fedavg",
    "fedlink.server.workflows.robust",
    "fedlink.server.workflows.strategies",
)
MiB = 1024**2
VARIABLE = "w"
#: The issue's targets.
ROUND_RATIO_TARGET = 1.5
ROBUST_TIME_RATIO_TARGET = 1.0
#: Below this model size the memory target is not judged (RSS noise of a few MiB is many models).
MEMORY_JUDGED_BYTES = MiB
QUICK_SIZE = (8, 20_000, 1)
DEFAULT_SIZE = (100, 1_000_000, 5)
TRIM_BETA = 0.2
KRUM_SELECT = 1
HONEST_SCALE = 0.01
OUTLIER_SCALE = 0.2
FEDAVGM_MOMENTUM = 0.9
STRATEGIES = ("FedAvg", "FedAvgM", "FedAdam")
RULES = ("median", "trimmed_mean", "krum")
SIDES = ("fedlink", "numpy")
#: The diagnostic run's glibc setting (``mallopt(M_MMAP_THRESHOLD)``, as ``MALLOC_MMAP_THRESHOLD_`` sets
#: it): every allocation of 128 KiB or more is its own mapping, returned to the kernel when freed. glibc
#: otherwise raises the threshold to the size of the first large block freed, and later update-sized
#: blocks come from the heap, which keeps the memory of blocks freed below its top.
FIXED_MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3
EPS32 = float(np.finfo(np.float32).eps)
T0 = datetime(2026, 1, 1, tzinfo=UTC)

Arrays = dict[str, NDArray[Any]]


class CheckFailed(RuntimeError):
    """A result is wrong, or a run did not do what it should: the bench stops."""


# ---------------------------------------------------------------- the workload


def initial_model(floats: int) -> NDArray[np.float32]:
    """The round's global model (the same in every process)."""
    return np.random.default_rng(0).standard_normal(floats, dtype=np.float32)


def default_krum_f(devices: int) -> int:
    """Krum's assumed malicious devices: a tenth of them, between 1 and 10."""
    return min(10, max(1, devices // 10))


def update_array(i: int, devices: int, floats: int, outliers: int) -> NDArray[np.float32]:
    """Device ``i``'s update (see the module docstring); the same in every process."""
    scale = OUTLIER_SCALE if i >= devices - outliers else HONEST_SCALE * (1.0 + i / devices)
    values = np.random.default_rng([1, i]).standard_normal(floats, dtype=np.float32)
    values *= np.float32(scale)
    return values


def weight(i: int) -> int:
    """Device ``i``'s ``num_examples``."""
    return i + 1


def reported(i: int, devices: int, floats: int, outliers: int) -> DXO:
    """Device ``i``'s update as the report path hands it over: a WEIGHT_DIFF DXO decoded from its bytes."""
    sent = DXO(
        kind=DataKind.WEIGHT_DIFF,
        data={VARIABLE: update_array(i, devices, floats, outliers)},
        meta={MetaKey.NUM_EXAMPLES: weight(i)},
    )
    return DXO.from_bytes(sent.to_bytes())


def round_tasks(devices: int) -> tuple[list[Task], list[str]]:
    """One round's train tasks, one per device, and their devices."""
    tasks = [
        Task(
            task_id=f"task-{i:05d}",
            job_id="job",
            run_id="run",
            round=1,
            name="train",
            payload_sha256=None,
            deadline=T0 + timedelta(hours=1),
            slots=1,
            targeted=True,
            state=TaskState.OPEN,
            created_at=T0,
        )
        for i in range(devices)
    ]
    return tasks, [f"device-{i:05d}" for i in range(devices)]


async def offer(holder: RoundUpdates, task: Task, update: DXO) -> None:
    """One report's update through the round holder, as the report path and a simulated device do."""
    request = f"request-{task.task_id}"
    if not holder.offer(task.task_id, request, update):
        raise CheckFailed(f"the round holder declined the update of {task.task_id}")
    holder.settle(task.task_id, request, accepted=True)
    await holder.absorbed(task.task_id, patience=60.0)


async def close(holder: RoundUpdates, devices: int) -> None:
    """Closes the round from what the holder took; every update must be in it."""
    if not await holder.finish_if_all_folded(devices) or holder.count != devices:
        raise CheckFailed(f"the round closed with {holder.count} of {devices} updates")


def check_close(what: str, got: NDArray[Any], expected: NDArray[Any], *, rows: int, max_abs: float) -> float:
    """Raises :class:`CheckFailed` unless ``got`` equals ``expected`` within float32 rounding.

    The tolerance per element: two float32 ulps of the expected value, plus ``rows`` float32 epsilons
    of the largest update (a float32 rule's arithmetic over ``rows`` values). Returns the largest error
    in units of that tolerance (at most 1).
    """
    if got.shape != expected.shape:
        raise CheckFailed(f"{what}: shape {got.shape}, expected {expected.shape}")
    reference = expected.astype(np.float64)
    tolerance = 2.0 * np.spacing(np.abs(reference).astype(np.float32)).astype(np.float64)
    tolerance += rows * EPS32 * max_abs
    error = np.abs(got.astype(np.float64) - reference)
    worst = float(np.max(error / tolerance)) if error.size else 0.0
    if not (np.all(np.isfinite(got)) and worst <= 1.0):
        at = int(np.argmax(error / tolerance))
        raise CheckFailed(
            f"{what}: off by up to {float(np.max(error)):.3g} ({worst:.3g} x the float32 tolerance; "
            f"element {at}: {float(got.reshape(-1)[at])!r}, expected {float(reference.reshape(-1)[at])!r})"
        )
    return worst


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# ---------------------------------------------------------------- (a) server steps against FedAvg


def step_params(strategy: str, rounds: int) -> FedAvgParams:
    """The parameters of a strategy of part (a)."""
    if strategy == "FedAvg":
        return FedAvgParams(num_rounds=rounds)
    if strategy == "FedAvgM":
        return FedAvgMParams(num_rounds=rounds, server_learning_rate=1.0, server_momentum=FEDAVGM_MOMENTUM)
    if strategy == "FedAdam":
        return FedAdamParams(num_rounds=rounds)
    raise ValueError(f"unknown strategy {strategy!r}")


def describe_step(params: FedAvgParams) -> str:
    """The server step's knobs, for the table."""
    if isinstance(params, FedAvgMParams):
        return f"lr {params.server_learning_rate:g}, momentum {params.server_momentum:g}"
    if isinstance(params, FedAdamParams):
        lr, b1, b2, tau = params.server_learning_rate, params.beta_1, params.beta_2, params.tau
        return f"lr {lr:g}, b1 {b1:g}, b2 {b2:g}, tau {tau:g}"
    return "model + mean"


async def timed_round(
    params: FedAvgParams, step: ServerStep, model: Arrays, updates: Sequence[DXO], round_no: int
) -> tuple[Arrays, float, float]:
    """One round: every update folded, the round closed, the server step; returns the new model and the
    seconds of the fold (with the close) and of the step."""
    tasks, devices = round_tasks(len(updates))
    start = time.perf_counter()
    holder = params.round_rule()(LazyModel.of(model))
    holder.expect(tasks, devices)
    for task, update in zip(tasks, updates, strict=True):
        await offer(holder, task, update)
    await close(holder, len(updates))
    folded = time.perf_counter()
    new = step.apply(model, holder.aggregate(), round_no=round_no)
    return new, folded - start, time.perf_counter() - folded


def _check_fedavg(new: NDArray[Any], model: NDArray[Any], updates: Sequence[DXO]) -> float:
    """FedAvg's new model against numpy's weighted mean, in float64."""
    total = np.zeros(model.shape, dtype=np.float64)
    weights = 0.0
    for update in updates:
        w = float(update.meta[MetaKey.NUM_EXAMPLES])  # type: ignore[arg-type]
        total += w * update.data[VARIABLE].astype(np.float64)
        weights += w
    expected = model.astype(np.float64) + total / weights
    max_abs = max(float(np.max(np.abs(u.data[VARIABLE]))) for u in updates)
    return check_close("FedAvg's new model", new, expected, rows=len(updates), max_abs=max_abs)


async def measure_steps(devices: int, floats: int, repeats: int, outliers: int) -> dict[str, Any]:
    """Part (a): rounds of each strategy, taking turns; medians and ratios to FedAvg."""
    updates = [reported(i, devices, floats, outliers) for i in range(devices)]
    start_model = {VARIABLE: initial_model(floats)}
    params = {name: step_params(name, repeats + 1) for name in STRATEGIES}
    steps = {name: params[name].server_step() for name in STRATEGIES}
    models = {name: start_model for name in STRATEGIES}
    runs: dict[str, dict[str, list[float]]] = {name: {"fold_s": [], "step_s": []} for name in STRATEGIES}
    check = 0.0
    # Warm-up (untimed): round 1 makes every state array (FedAvgM's buffer is the first delta).
    for name in STRATEGIES:
        models[name], _, _ = await timed_round(params[name], steps[name], models[name], updates, 1)
        if name == "FedAvg":
            check = _check_fedavg(models[name][VARIABLE], start_model[VARIABLE], updates)
    for repeat in range(repeats):
        shift = repeat % len(STRATEGIES)
        for name in STRATEGIES[shift:] + STRATEGIES[:shift]:
            model, fold_s, step_s = await timed_round(
                params[name], steps[name], models[name], updates, repeat + 2
            )
            if not np.all(np.isfinite(model[VARIABLE])):
                raise CheckFailed(f"{name}'s round {repeat + 2} made a model that is not finite")
            models[name] = model
            runs[name]["fold_s"].append(fold_s)
            runs[name]["step_s"].append(step_s)
    rows: dict[str, Any] = {}
    for name in STRATEGIES:
        rounds = [f + s for f, s in zip(runs[name]["fold_s"], runs[name]["step_s"], strict=True)]
        rows[name] = {
            "server_step": describe_step(params[name]),
            "fold_s": _median(runs[name]["fold_s"]),
            "step_s": _median(runs[name]["step_s"]),
            "round_s": _median(rounds),
            "runs": runs[name] | {"round_s": rounds},
        }
    for name in STRATEGIES:
        rows[name]["ratio_to_fedavg"] = rows[name]["round_s"] / rows["FedAvg"]["round_s"]
    return {"strategies": rows, "fedavg_check_worst_in_tolerance": check}


# ---------------------------------------------------------------- (b) robust rules against numpy


@dataclass(frozen=True, slots=True)
class RobustJob:
    """One child process's run of part (b)."""

    side: str
    rule: str
    devices: int
    floats: int
    krum_f: int
    #: Where the child writes its aggregate and new model (``<tag>.aggregate.npy``, ``<tag>.model.npy``).
    out_dir: str
    tag: str
    #: Fix glibc's mmap threshold at this many bytes first (the diagnostic run); None leaves glibc's.
    mmap_threshold: int | None = None


def robust_params(rule: str, devices: int, krum_f: int) -> RobustParams:
    """fedlink's parameters of a rule of part (b)."""
    if rule == "median":
        return FedMedianParams(num_rounds=1, devices_per_round=devices)
    if rule == "trimmed_mean":
        return FedTrimmedAvgParams(num_rounds=1, devices_per_round=devices, beta=TRIM_BETA)
    if rule == "krum":
        return KrumParams(
            num_rounds=1, devices_per_round=devices, num_malicious=krum_f, num_to_select=KRUM_SELECT
        )
    raise ValueError(f"unknown rule {rule!r}")


def numpy_median(stack: NDArray[np.float32], weights: NDArray[np.float64], krum_f: int) -> NDArray[Any]:
    """The coordinate-wise median, numpy's own."""
    result: NDArray[Any] = np.median(stack, axis=0)
    return result


def numpy_trimmed_mean(stack: NDArray[np.float32], weights: NDArray[np.float64], krum_f: int) -> NDArray[Any]:
    """Sort every coordinate, cut ``floor(beta * n)`` values from each end, average the rest."""
    n = stack.shape[0]
    cut = int(TRIM_BETA * n)
    result: NDArray[Any] = np.sort(stack, axis=0)[cut : n - cut].mean(axis=0)
    return result


def numpy_krum(stack: NDArray[np.float32], weights: NDArray[np.float64], krum_f: int) -> NDArray[Any]:
    """Flower's Krum with the distances from the Gram matrix: each update's score is the sum of its
    squared distances to its ``n - f - 2`` nearest others; the weighted mean of the best scored."""
    n = stack.shape[0]
    gram = stack @ stack.T
    norms = np.diag(gram)
    distances = norms[:, None] + norms[None, :] - 2.0 * gram
    closest = max(1, n - krum_f - 2)
    scores = np.array([distances[i, np.argsort(distances[i])[1 : closest + 1]].sum() for i in range(n)])
    chosen = np.sort(np.argsort(scores, kind="stable")[:KRUM_SELECT])
    result: NDArray[Any] = np.tensordot(weights[chosen], stack[chosen], axes=1) / weights[chosen].sum()
    return result


NUMPY_RULES: Mapping[str, Callable[[NDArray[np.float32], NDArray[np.float64], int], NDArray[Any]]] = {
    "median": numpy_median,
    "trimmed_mean": numpy_trimmed_mean,
    "krum": numpy_krum,
}


def _rss() -> int:
    return memory_use(os.getpid()).rss_bytes


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _reset_peak() -> None:
    """Resets this process's peak RSS (``VmHWM``) to its RSS now (Linux 4.0+: ``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def _peak_since_reset() -> int:
    """``VmHWM``: the peak RSS since :func:`_reset_peak`."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM")


@dataclass(slots=True)
class _Baseline:
    """A child's RSS just before its first update is made, and its ``ru_maxrss`` then."""

    rss: int
    max_rss: int

    @classmethod
    def now(cls) -> _Baseline:
        gc.collect()
        return cls(_rss(), _max_rss())


@dataclass(slots=True)
class _Measured:
    seconds: float
    before: _Baseline
    held: int
    peak: int
    aggregate: NDArray[Any]
    model: NDArray[Any]
    #: The seconds of the two parts of ``seconds``: fedlink's close (stacking the held updates; Krum
    #: scores them there) and server step (the rule's blocks, into the new model); numpy's stack and
    #: rule (with model + aggregate).
    parts: tuple[float, float]
    max_abs_update: float | None = None
    #: fedlink: the seconds the updates spent in the holder as they arrived (untimed in ``seconds``).
    arrival_s: float | None = None
    #: The peak RSS of the timed part alone (``VmHWM`` reset once every update was held).
    close_peak: int = 0


async def _hand_over(holder: RoundUpdates, job: RobustJob) -> float:
    """Offers every update as it is made; returns the seconds spent in the holder (each update's
    offer, settle and copy into the round's rows), not in making the updates."""
    tasks, devices = round_tasks(job.devices)
    holder.expect(tasks, devices)
    in_holder = 0.0
    for i, task in enumerate(tasks):
        update = reported(i, job.devices, job.floats, job.krum_f)
        start = time.perf_counter()
        await offer(holder, task, update)
        in_holder += time.perf_counter() - start
        del update  # the holder's is the only reference
    return in_holder


def _fedlink_side(job: RobustJob, model: NDArray[np.float32]) -> _Measured:
    params = robust_params(job.rule, job.devices, job.krum_f)
    holder = params.round_rule()(LazyModel.of({VARIABLE: model}))
    step = params.server_step()
    loop = asyncio.new_event_loop()
    try:
        before = _Baseline.now()
        arrival = loop.run_until_complete(_hand_over(holder, job))
        held = _rss()
        making_peak = _max_rss()  # clear_refs resets ru_maxrss too
        _reset_peak()
        start = time.perf_counter()
        loop.run_until_complete(close(holder, job.devices))
        closed = time.perf_counter()
        new = step.apply({VARIABLE: model}, holder.aggregate(), round_no=1)[VARIABLE]
        end = time.perf_counter()
        close_peak = _peak_since_reset()
        peak = max(making_peak, close_peak)
    finally:
        loop.close()
    # Untimed, after the peak was read: the aggregate again (the rule's blocks, from the round's stacks).
    aggregate = np.concatenate([part.copy() for _, part in holder.aggregate().steps(VARIABLE)])
    parts = (closed - start, end - closed)
    return _Measured(
        end - start, before, held, peak, aggregate, new, parts, arrival_s=arrival, close_peak=close_peak
    )


def _numpy_side(job: RobustJob, model: NDArray[np.float32]) -> _Measured:
    before = _Baseline.now()
    updates = [update_array(i, job.devices, job.floats, job.krum_f) for i in range(job.devices)]
    weights = np.array([weight(i) for i in range(job.devices)], dtype=np.float64)
    held = _rss()
    making_peak = _max_rss()  # clear_refs resets ru_maxrss too
    _reset_peak()
    start = time.perf_counter()
    stack = np.stack(updates)
    stacked = time.perf_counter()
    aggregate = NUMPY_RULES[job.rule](stack, weights, job.krum_f)
    new = (model + aggregate).astype(np.float32, copy=False)
    end = time.perf_counter()
    close_peak = _peak_since_reset()
    peak = max(making_peak, close_peak)
    max_abs = max(float(np.max(np.abs(u))) for u in updates)
    parts = (stacked - start, end - stacked)
    return _Measured(
        end - start, before, held, peak, aggregate, new, parts, max_abs_update=max_abs, close_peak=close_peak
    )


def _fix_mmap_threshold(size: int) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if libc.mallopt(_M_MMAP_THRESHOLD, size) != 1:
        raise CheckFailed(f"mallopt(M_MMAP_THRESHOLD, {size}) failed")


def robust_child(job: RobustJob) -> dict[str, Any]:
    """Runs one side of one rule once (in a fresh process) and writes its arrays for the check."""
    if job.mmap_threshold is not None:
        _fix_mmap_threshold(job.mmap_threshold)
    model = initial_model(job.floats)
    measured = (_fedlink_side if job.side == "fedlink" else _numpy_side)(job, model)
    out = Path(job.out_dir)
    np.save(out / f"{job.tag}.aggregate.npy", measured.aggregate)
    np.save(out / f"{job.tag}.model.npy", measured.model)
    before = measured.before
    return {
        "seconds": measured.seconds,
        "parts_s": list(measured.parts),
        "arrival_s": measured.arrival_s,
        "held_bytes": measured.held - before.rss,
        "peak_bytes": measured.peak - before.rss,
        "close_peak_bytes": measured.close_peak - before.rss,
        "rss_before_bytes": before.rss,
        # The child's ru_maxrss before its first update, over its RSS then: the peak figure cannot be
        # lower than this (its import peak, or the fork server's), only higher.
        "inherited_peak_bytes": before.max_rss - before.rss,
        # False: the round never rose above that earlier peak, so its own peak is not known (at most
        # the figure given): not judged.
        "peak_measured": measured.peak > before.max_rss,
        "max_abs_update": measured.max_abs_update,
    }


def _child_entry(send: Connection, job: RobustJob) -> None:
    die_with_multiprocessing_parent()  # a bench killed by a timeout leaves no child computing on
    try:
        record: dict[str, Any] = robust_child(job)
    except BaseException:  # reported to the parent, which stops the bench
        record = {"error": traceback.format_exc()}
    send.send(record)
    send.close()


def start_children() -> multiprocessing.context.ForkServerContext:
    """The children's start method: forked from a fork server that imported this module's imports and
    nothing else (each child then runs this module itself, as multiprocessing runs a main module).

    Not spawned from this process: a child's ``ru_maxrss`` starts at its parent's peak at the fork (Linux
    keeps it across the fork and the exec), and this process peaks above a round's size in part (a).
    The fork server is started now, before part (a); its children start from its own peak, that of the
    imports, which their RSS before the updates already holds.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()
    return context


def run_child(
    context: multiprocessing.context.ForkServerContext, job: RobustJob, timeout_s: float
) -> dict[str, Any]:
    """Runs ``job`` in a fresh child process."""
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child_entry, args=(send, job), name=f"strategy-bench-{job.tag}")
    process.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            process.kill()
            raise CheckFailed(f"{job.tag}: no result after {timeout_s:g} s")
        record: dict[str, Any] = receive.recv()
    except EOFError:
        process.join()
        raise CheckFailed(f"{job.tag}: the child died (exit status {process.exitcode})") from None
    finally:
        receive.close()
        process.join()
    if "error" in record:
        raise CheckFailed(f"{job.tag} failed in its child:\n{record['error']}")
    return record


def check_pair(
    rule: str, fedlink_tag: str, numpy_tag: str, out_dir: Path, *, rows: int, max_abs: float
) -> float:
    """fedlink's aggregate and new model against numpy's, within float32 rounding; the worst error."""

    def load(tag: str, what: str) -> NDArray[Any]:
        array: NDArray[Any] = np.load(out_dir / f"{tag}.{what}.npy")
        return array

    worst = check_close(
        f"{rule}: fedlink's aggregate",
        load(fedlink_tag, "aggregate"),
        load(numpy_tag, "aggregate"),
        rows=rows,
        max_abs=max_abs,
    )
    # The new models: each side rounded model + aggregate to float32 once more.
    fedlink_model, numpy_model = load(fedlink_tag, "model"), load(numpy_tag, "model")
    if fedlink_model.dtype != np.float32:
        raise CheckFailed(f"{rule}: fedlink's new model is {fedlink_model.dtype}, not float32")
    worst_model = check_close(
        f"{rule}: fedlink's new model", fedlink_model, numpy_model, rows=rows, max_abs=max_abs
    )
    return max(worst, worst_model)


def _summary(runs: Sequence[dict[str, Any]], model_bytes: int) -> dict[str, Any]:
    peak = max(r["peak_bytes"] for r in runs)
    held = max(r["held_bytes"] for r in runs)
    return {
        "seconds": _median([r["seconds"] for r in runs]),
        "seconds_runs": [r["seconds"] for r in runs],
        # Medians of each part (fedlink: close, step; numpy: stack, rule).
        "parts_s": [_median([r["parts_s"][i] for r in runs]) for i in range(2)],
        # fedlink: the holder's time while the updates arrived (offer, settle, copy into the rows).
        "arrival_s": None if runs[0]["arrival_s"] is None else _median([r["arrival_s"] for r in runs]),
        "held_mib": held / MiB,
        "held_models": held / model_bytes,
        "peak_mib": peak / MiB,
        "peak_models": peak / model_bytes,
        "peak_mib_runs": [r["peak_bytes"] / MiB for r in runs],
        "close_peak_models": max(r["close_peak_bytes"] for r in runs) / model_bytes,
        "inherited_peak_mib": max(r["inherited_peak_bytes"] for r in runs) / MiB,
        "peak_measured": all(r["peak_measured"] for r in runs),
    }


def measure_robust(
    context: multiprocessing.context.ForkServerContext,
    devices: int,
    floats: int,
    repeats: int,
    krum_f: int,
    timeout_s: float,
    *,
    diagnose: bool,
) -> dict[str, Any]:
    """Part (b): every rule, both sides alternating, each run in a fresh child; checked, summarised."""
    model_bytes = floats * 4
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {rule: {s: [] for s in SIDES} for rule in RULES}
    worst: dict[str, float] = dict.fromkeys(RULES, 0.0)
    diagnostic: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="fedlink-strategy-bench-") as scratch:
        for repeat in range(repeats):
            shift = repeat % len(RULES)
            for rule in RULES[shift:] + RULES[:shift]:
                tags = {}
                for side in SIDES if repeat % 2 == 0 else SIDES[::-1]:
                    tags[side] = tag = f"{rule}-{side}-{repeat}"
                    job = RobustJob(side, rule, devices, floats, krum_f, scratch, tag)
                    record = run_child(context, job, timeout_s)
                    runs[rule][side].append(record)
                    print(
                        f"  {rule:<12} {side:<7} repeat {repeat + 1}: {record['seconds']:.3f} s, "
                        f"peak {record['peak_bytes'] / model_bytes:.1f} models",
                        flush=True,
                    )
                max_abs = runs[rule]["numpy"][-1]["max_abs_update"]
                error = check_pair(
                    rule, tags["fedlink"], tags["numpy"], Path(scratch), rows=devices, max_abs=max_abs
                )
                worst[rule] = max(worst[rule], error)
        if diagnose:
            for rule in RULES:
                tag = f"{rule}-fixed-mmap"
                job = RobustJob("fedlink", rule, devices, floats, krum_f, scratch, tag, FIXED_MMAP_THRESHOLD)
                record = run_child(context, job, timeout_s)
                diagnostic[rule] = {
                    "peak_models": record["peak_bytes"] / model_bytes,
                    "peak_mib": record["peak_bytes"] / MiB,
                    "seconds": record["seconds"],
                }
    rows: dict[str, Any] = {}
    for rule in RULES:
        fedlink, plain = (
            _summary(runs[rule]["fedlink"], model_bytes),
            _summary(runs[rule]["numpy"], model_bytes),
        )
        rows[rule] = {
            "fedlink": fedlink,
            "numpy": plain,
            "time_ratio": fedlink["seconds"] / plain["seconds"],
            "check_worst_in_tolerance": worst[rule],
        }
    measured = all(r["peak_measured"] for rule in RULES for r in runs[rule]["fedlink"])
    return {
        "model_bytes": model_bytes,
        "bound_models": devices + 1,
        "memory_judged": model_bytes >= MEMORY_JUDGED_BYTES and measured,
        "rules": rows,
        "fixed_mmap_threshold": diagnostic or None,
        "memory_measure": "child's ru_maxrss after the round minus its VmRSS before the first update",
    }


# ---------------------------------------------------------------- the report


def targets(report: Mapping[str, Any]) -> dict[str, bool | None]:
    """Which of the issue's targets the figures meet (None: not measured, or too small to judge)."""
    result: dict[str, bool | None] = {}
    strategies = (report.get("steps") or {}).get("strategies", {})
    for name in ("FedAvgM", "FedAdam"):
        row = strategies.get(name)
        result[f"{name.lower()}_round_within_1.5x_fedavg"] = (
            None if row is None else row["ratio_to_fedavg"] <= ROUND_RATIO_TARGET
        )
    robust = report.get("robust") or {}
    rules = robust.get("rules", {})
    for rule in RULES:
        row = rules.get(rule)
        result[f"{rule}_no_slower_than_numpy"] = (
            None if row is None else row["time_ratio"] <= ROBUST_TIME_RATIO_TARGET
        )
    for rule in RULES:
        row = rules.get(rule)
        judged = row is not None and robust.get("memory_judged")
        result[f"{rule}_peak_within_bound"] = (
            row["fedlink"]["close_peak_models"] <= robust["bound_models"] if judged and row else None
        )
    return result


def format_steps(steps: Mapping[str, Any], devices: int, floats: int, repeats: int) -> str:
    """Part (a)'s table."""
    lines = [
        f"(a) one round, {devices} devices x {floats:,} float32: the fold of every update (with the close) "
        f"plus the server step; medians of {repeats} rounds, strategies taking turns",
        f"{'strategy':<9} {'server step':<38} {'fold s':>8} {'step s':>8} {'round s':>8} {'/FedAvg':>8}",
    ]
    lines.append("-" * len(lines[-1]))
    for name in STRATEGIES:
        row = steps["strategies"][name]
        lines.append(
            f"{name:<9} {row['server_step']:<38} {row['fold_s']:8.4f} {row['step_s']:8.4f} "
            f"{row['round_s']:8.4f} {row['ratio_to_fedavg']:7.2f}x"
        )
    return "\n".join(lines)


def format_robust(robust: Mapping[str, Any], devices: int, floats: int, repeats: int) -> str:
    """Part (b)'s table."""
    model_mib = robust["model_bytes"] / MiB
    lines = [
        f"(b) robust rules vs plain numpy, {devices} devices x {floats:,} float32 "
        f"(model {model_mib:.2f} MiB), each run a fresh child process;",
        f"    time: from every update held to the new model, median of {repeats}; peak: the child's "
        f"ru_maxrss after the round minus its VmRSS before the first update (so with the making of the "
        f"updates), close peak: the same from the close alone (VmHWM reset once every update was held; "
        f"judged), in model sizes, largest of {repeats}",
        f"{'rule':<12} {'side':<7} {'time s':>8} {'of which':<24} {'fl/np':>6} {'held MiB':>9} "
        f"{'peak MiB':>9} {'peak':>6} {'close peak':>10} {'bound':>6}  check",
    ]
    lines.append("-" * len(lines[-1]))
    for rule in RULES:
        row = robust["rules"][rule]
        for side in SIDES:
            figures = row[side]
            ours = side == "fedlink"
            first, second = figures["parts_s"]
            parts = (
                f"close {first:.3f} + step {second:.3f}" if ours else f"stack {first:.3f} + rule {second:.3f}"
            )
            line = (
                f"{rule:<12} {side:<7} {figures['seconds']:8.3f} {parts:<24} "
                f"{(format(row['time_ratio'], '5.2f') + 'x') if ours else '':>6} "
                f"{figures['held_mib']:9.1f} {figures['peak_mib']:9.1f} {figures['peak_models']:6.1f} "
                f"{figures['close_peak_models']:10.1f} "
                f"{robust['bound_models'] if ours else '':>6}  "
                + (f"equal (worst {row['check_worst_in_tolerance']:.2f} of the tolerance)" if ours else "")
            )
            lines.append(line.rstrip())
    arrivals = ", ".join(
        f"{rule} {robust['rules'][rule]['fedlink']['arrival_s']:.3f} s"
        for rule in RULES
        if robust["rules"].get(rule) and robust["rules"][rule]["fedlink"].get("arrival_s") is not None
    )
    if arrivals:
        lines.append(
            f"fedlink copies each accepted update into the round's rows as it arrives (not in the times "
            f"above; numpy's stack is): {arrivals} over the round's {devices} updates"
        )
    lines.append(
        f"bound: the {devices} updates held plus one model = {robust['bound_models']} model sizes "
        f"({robust['bound_models'] * model_mib:.1f} MiB)"
        + (
            ""
            if robust["memory_judged"]
            else " (not judged: under a 1 MiB model, or a peak not above the import's)"
        )
    )
    fixed = robust.get("fixed_mmap_threshold")
    if fixed:
        lines.append(
            f"fedlink with glibc's mmap threshold fixed at {FIXED_MMAP_THRESHOLD // 1024} KiB (not judged): "
            + ", ".join(f"{rule} {fixed[rule]['peak_models']:.1f} models" for rule in RULES)
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs part (a) in this process and part (b) in children; prints both tables and the targets."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="8 devices x 20,000 floats, one repeat")
    parser.add_argument("--devices", type=int, default=None, help="default 100")
    parser.add_argument(
        "--floats", type=int, default=None, help="float32 elements of the model; default 1000000"
    )
    parser.add_argument("--repeats", type=int, default=None, help="rounds / runs per figure; default 5")
    parser.add_argument(
        "--krum-f", type=int, default=None, help="Krum's num_malicious; default devices/10, 1..10"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per child run")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args(argv)
    size = QUICK_SIZE if args.quick else DEFAULT_SIZE
    devices = args.devices or size[0]
    floats = args.floats or size[1]
    repeats = max(1, args.repeats or size[2])
    krum_f = args.krum_f if args.krum_f is not None else default_krum_f(devices)
    if devices < 3 or not 0 <= krum_f < devices or floats < 1:
        parser.error("needs at least 3 devices, 0 <= krum-f < devices and at least one float")
    report: dict[str, Any] = {
        "config": {
            "devices": devices,
            "floats": floats,
            "repeats": repeats,
            "krum_f": krum_f,
            "quick": args.quick,
            "cpus": os.cpu_count(),
            "load_avg_1m_before": os.getloadavg()[0],
        },
        "steps": None,
        "robust": None,
        "ok": False,
    }

    def save() -> None:
        report["targets"] = targets(report)
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=2) + "\n")

    children = start_children()  # before part (a): see start_children
    try:
        print(f"(a) {len(STRATEGIES)} strategies x {repeats + 1} rounds (one warm-up) ...", flush=True)
        report["steps"] = asyncio.run(measure_steps(devices, floats, repeats, krum_f))
        save()
        gc.collect()
        print(
            f"(b) {len(RULES)} rules x {len(SIDES)} sides x {repeats} runs, each in a fresh child ...",
            flush=True,
        )
        report["robust"] = measure_robust(
            children,
            devices,
            floats,
            repeats,
            krum_f,
            args.timeout,
            diagnose=floats * 4 >= MEMORY_JUDGED_BYTES,
        )
    except CheckFailed as exc:
        save()
        print(f"checks: FAILED: {exc}", file=sys.stderr)
        print("checks: FAILED")
        return 1
    report["ok"] = True
    save()
    print()
    print(format_steps(report["steps"], devices, floats, repeats))
    print()
    print(format_robust(report["robust"], devices, floats, repeats))
    print()
    print(targets_line(report["targets"]))
    print("checks: all passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
