"""Asynchronous FedBuff against synchronous FedAvg on slow, flaky devices: accuracy over (virtual) time.

One command runs the whole study (about a minute on two cores)::

    .venv/bin/python examples/fedbuff_study/study.py --out docs/images/fedbuff-vs-fedavg.png

What it does, in order:

1. Splits scikit-learn's digits as the quickstart does (the stratified 75% federated, the 25% held out
   and never seen by a device), the federated part over ``--devices`` virtual devices with label skew
   (Dirichlet, alpha 0.5).
2. Runs four simulations of the built-in ``SoftmaxRegressionTrainer`` on the same devices and the same
   data, on the scaled clock (``time_scale``: simulated minutes take real seconds): FedAvg and FedBuff
   with heterogeneous devices (log-normal compute times with a heavy tail, a speed factor per device,
   drop-outs), then both again with every device taking exactly the median compute time (the no-delay
   baseline NVIDIA FLARE compared against).
3. Keeps every global model the run made (FedAvg's rounds, FedBuff's versions: the store's checkpoints,
   ``keep_checkpoints`` as large as the run) and evaluates each one centrally on the held-out split:
   FedBuff has no device-side evaluation, so both curves are measured the same way.
4. Prints a table (virtual minutes to the target accuracy, final accuracy, rounds or versions, updates
   aggregated, and the time over the no-delay run) and draws accuracy against virtual minutes, both
   curves and the target in one figure.

Every draw is seeded (the split, the devices' compute times, drop-outs and speeds, the sampling, the
trainer); ``--seed`` changes them all, and the script prints the seed's numbers. They are not bit for
bit the same from one run of a seed to the next: the machine's own time (training, the store) counts
``time_scale`` times over, so two devices finishing within a simulated second or so may arrive in
either order, which changes what FedBuff folds into a version and which late result FedAvg's round
timeout cuts. The ordering of the two workflows does not move (see README.md for the spread measured).
``--json`` prints the numbers as one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from fedlink.common.dxo import DXO
from fedlink.runner.data import ArrayDataSource, PartitionedDataSource
from fedlink.server.store import open_store
from fedlink.server.workflows.fedavg import FedAvgParams
from fedlink.server.workflows.fedbuff import FedBuffParams
from fedlink.simulation import Heterogeneity, SimulationJob, SimulationResult, run_simulation

__all__ = [
    "Arm",
    "Curve",
    "Digits",
    "StudyConfig",
    "draw",
    "evaluate_versions",
    "main",
    "run_study",
    "table",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class StudyConfig:
    """Everything the study depends on; the defaults are the published run (see README.md)."""

    #: Virtual devices; 16 of them train at once in either workflow (FLARE's comparison ran 16).
    devices: int = 32
    #: Seeds the split, the devices' draws, the sampling and the trainer.
    seed: int = 0
    #: Dirichlet label skew of the split (smaller: each device sees fewer digits).
    alpha: float = 0.5
    #: Held-out accuracy whose first crossing is timed (and drawn).
    target: float = 0.85
    #: Median simulated seconds one training task takes on a device.
    median_compute_s: float = 30.0
    #: Log-normal sigma of a task's compute time around its device's median: the heavy tail
    #: (sigma 1: one task in 20 takes over 5x the median, one in 100 over 10x).
    task_sigma: float = 1.0
    #: Log-normal sigma of a device's speed factor (sigma 0.6: the slowest of 32 is ~3.5x the median).
    speed_sigma: float = 0.6
    #: Probability that a device drops a task it was given (it gives the task back).
    dropout: float = 0.1
    #: Simulated seconds per real second.
    time_scale: float = 50.0
    #: FedAvg: rounds, devices sampled per round, results it needs, and how long a round waits.
    rounds: int = 15
    devices_per_round: int = 16
    min_results: int = 4
    round_timeout_s: float = 60.0
    #: FedBuff: versions, devices holding a task at once, updates per version (K), history.
    versions: int = 60
    selection: int = 16
    updates_per_version: int = 4
    max_model_history: int = 8
    staleness_weight: bool = True
    task_timeout_s: float = 600.0
    #: The trainer: passes over the local data per task, batch size, learning rate.
    epochs: int = 2
    batch_size: int = 16
    learning_rate: float = 0.2

    def heterogeneity(self) -> Heterogeneity:
        """The slow, flaky devices."""
        return Heterogeneity(
            compute_time_s=(self.median_compute_s, self.task_sigma),
            speed_sigma=self.speed_sigma,
            dropout=self.dropout,
        )

    def no_delay(self) -> Heterogeneity:
        """The baseline: every task takes exactly the median compute time, and no device drops out."""
        return Heterogeneity(compute_time_s=(self.median_compute_s, 0.0))

    def fedavg(self) -> FedAvgParams:
        """Synchronous FedAvg as a user with stragglers would set it up (see README.md)."""
        return FedAvgParams(
            num_rounds=self.rounds,
            devices_per_round=self.devices_per_round,
            min_results=self.min_results,
            round_timeout_s=self.round_timeout_s,
            seed=self.seed,
            keep_checkpoints=self.rounds,
        )

    def fedbuff(self) -> FedBuffParams:
        """Asynchronous FedBuff (see README.md)."""
        return FedBuffParams(
            max_model_version=self.versions,
            device_selection_size=self.selection,
            num_updates_for_model=self.updates_per_version,
            max_model_history=self.max_model_history,
            staleness_weight=self.staleness_weight,
            task_timeout_s=self.task_timeout_s,
            seed=self.seed,
            keep_checkpoints=self.versions,
        )

    def trainer(self) -> dict[str, Any]:
        """The devices' runner configuration: the built-in softmax regression."""
        args = {
            "epochs": self.epochs,
            "batch_size": self.batch_size,
            "learning_rate": self.learning_rate,
            "seed": self.seed,
        }
        return {
            "components": [{"type": "SoftmaxRegressionTrainer", "name": "trainer", "args": args}],
            "executors": {"*": "@trainer"},
        }


class Digits:
    """The quickstart's digits: scaled to [0, 1], the stratified 75% federated, 25% held out."""

    def __init__(self, seed: int) -> None:
        x, y = load_digits(return_X_y=True)
        x = (x / 16.0).astype(np.float32)
        y = y.astype(np.int64)
        self.x_fed, self.x_test, self.y_fed, self.y_test = train_test_split(
            x, y, test_size=0.25, stratify=y, random_state=seed
        )
        self.seed = seed

    def source(self, alpha: float) -> PartitionedDataSource:
        """Device ``i`` trains on partition ``i`` of the federated split (Dirichlet label skew)."""
        train = ArrayDataSource({"train": (self.x_fed, self.y_fed)})
        return PartitionedDataSource(train, method="dirichlet", alpha=alpha, seed=self.seed)

    def accuracy(self, arrays: dict[str, npt.NDArray[Any]]) -> float:
        """Held-out top-1 accuracy of a softmax regression model (``weight``, ``bias``)."""
        logits = self.x_test @ arrays["weight"] + arrays["bias"]
        return float(np.mean(np.argmax(logits, axis=1) == self.y_test))


def initial_model() -> dict[str, npt.NDArray[np.float32]]:
    """Zeros, as the quickstart's ``initial.npz``: 64 features, 10 classes."""
    return {"weight": np.zeros((64, 10), np.float32), "bias": np.zeros(10, np.float32)}


@dataclass(frozen=True, slots=True, kw_only=True)
class Curve:
    """Held-out accuracy of every global model a run made, against the virtual time it was made."""

    #: The round (FedAvg) or model version (FedBuff) of each model; 0 is the initial model.
    steps: tuple[int, ...]
    #: Virtual seconds from the job's first event to the model's making (0 for the initial model).
    times_s: tuple[float, ...]
    accuracies: tuple[float, ...]

    def time_to(self, target: float) -> float | None:
        """Virtual seconds until a model first reached ``target``; None if none did."""
        for time_s, accuracy in zip(self.times_s, self.accuracies, strict=True):
            if accuracy >= target:
                return time_s
        return None

    def time_held(self, target: float) -> float | None:
        """Virtual seconds from which every later model kept ``target`` (a noisy curve may touch it
        sooner); None if the last model is below it."""
        held: float | None = None
        for time_s, accuracy in zip(self.times_s, self.accuracies, strict=True):
            if accuracy < target:
                held = None
            elif held is None:
                held = time_s
        return held

    @property
    def final_accuracy(self) -> float:
        """The last model's accuracy."""
        return self.accuracies[-1]

    @property
    def end_s(self) -> float:
        """Virtual seconds until the last model was made."""
        return self.times_s[-1]


@dataclass(frozen=True, slots=True, kw_only=True)
class Arm:
    """One run of the study: a workflow on heterogeneous devices, or on the no-delay baseline."""

    name: str
    workflow: str
    delays: bool
    curve: Curve
    #: Updates aggregated over the run (results of FedAvg's rounds, FedBuff's buffered updates).
    updates: int
    #: Simulated drop-outs (tasks given back).
    dropouts: int
    #: Real seconds the run took.
    wall_s: float
    #: Held-out accuracy of the run's final model (the simulation's result): the curve's last point.
    final_model_accuracy: float
    extra: dict[str, float] = field(default_factory=dict)


def evaluate_versions(result: SimulationResult, store_path: Path, digits: Digits) -> Curve:
    """Evaluates every global model the run kept (the store's checkpoints, one per round or version).

    The run must have kept them all (``keep_checkpoints`` at least the rounds or versions): a model
    whose checkpoint is missing raises, rather than leaving a hole in the curve.
    """
    models = asyncio.run(_checkpointed_models(result, store_path))
    when = {record.round: record.virtual_time_s for record in result.rounds}
    missing = sorted(set(when) - set(models))
    if missing:
        raise RuntimeError(
            f"the store kept no checkpoint of rounds/versions {missing}: raise keep_checkpoints"
        )
    steps = sorted(when)
    return Curve(
        steps=(0, *steps),
        times_s=(0.0, *(when[s] for s in steps)),
        accuracies=(digits.accuracy(initial_model()), *(digits.accuracy(models[s]) for s in steps)),
    )


async def _checkpointed_models(
    result: SimulationResult, store_path: Path
) -> dict[int, dict[str, npt.NDArray[Any]]]:
    async with open_store(result.store_url, blob_dir=Path(f"{store_path}.blobs")) as store:
        run = await store.get_current_run(result.job_id)
        models: dict[int, dict[str, npt.NDArray[Any]]] = {}
        for checkpoint in await store.list_checkpoints(run.run_id):
            dxo = DXO.from_bytes(await store.blobs.read(checkpoint.model_sha256))
            models[checkpoint.round] = {name: np.asarray(value) for name, value in dxo.data.items()}
        return models


def run_arm(config: StudyConfig, digits: Digits, workdir: Path, *, workflow: str, delays: bool) -> Arm:
    """Runs one workflow on the study's devices and evaluates every model it made."""
    params: FedAvgParams | FedBuffParams = config.fedavg() if workflow == "fedavg" else config.fedbuff()
    name = f"{workflow}-{'delays' if delays else 'no-delay'}"
    job = SimulationJob(name=name, workflow=params, model=initial_model(), job_data=config.trainer())
    store = workdir / f"{name}.db"
    result = run_simulation(
        job,
        config.devices,
        data=digits.source(config.alpha),
        seed=config.seed,
        heterogeneity=config.heterogeneity() if delays else config.no_delay(),
        store=store,
        time_scale=config.time_scale,
    )
    curve = evaluate_versions(result, store, digits)
    extra: dict[str, float] = {}
    if workflow == "fedbuff":
        staleness = [r.metrics.get("mean_staleness", math.nan) for r in result.rounds]
        extra["mean_staleness"] = float(np.nanmean(staleness)) if staleness else math.nan
    return Arm(
        name=name,
        workflow=workflow,
        delays=delays,
        curve=curve,
        updates=sum(r.num_results for r in result.rounds),
        dropouts=len(result.dropouts),
        wall_s=result.wall_time_s,
        final_model_accuracy=digits.accuracy(result.arrays),
        extra=extra,
    )


def run_study(config: StudyConfig, *, baseline: bool = True, log: bool = True) -> list[Arm]:
    """Runs FedAvg and FedBuff with delays (and, with ``baseline``, without); returns the arms."""
    digits = Digits(config.seed)
    arms: list[Arm] = []
    with tempfile.TemporaryDirectory(prefix="fedlink-fedbuff-study-") as tmp:
        for delays in (True, False) if baseline else (True,):
            for workflow in ("fedavg", "fedbuff"):
                arm = run_arm(config, digits, Path(tmp), workflow=workflow, delays=delays)
                if log:
                    print(
                        f"  {arm.name}: {len(arm.curve.steps) - 1} models, "
                        f"{arm.curve.end_s / 60:.1f} virtual min in {arm.wall_s:.1f} s",
                        file=sys.stderr,
                    )
                arms.append(arm)
    return arms


def _minutes(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds / 60:.1f}"


#: The accuracies the table times besides the target (one is near FedAvg's plateau, where its time
#: to it is mostly luck: see README.md).
THRESHOLDS = (0.80, 0.85, 0.90)


def table(config: StudyConfig, arms: Sequence[Arm]) -> str:
    """The study's table: virtual minutes to each threshold (first crossing), from when the target was
    held for good, final accuracy, models, updates, and the time over the no-delay run of the same
    workflow (to the target, and to the end: FLARE's measure)."""
    base = {a.workflow: a for a in arms if not a.delays}
    thresholds = sorted({*THRESHOLDS, config.target})
    header = f"{'run':<17}" + "".join(f" {'min to ' + format(t, '.0%'):>10}" for t in thresholds)
    header += f" {'held ' + format(config.target, '.0%') + ' from':>14}"
    header += (
        f" {'final acc':>9} {'models':>6} {'updates':>7} {'drops':>5} {'end min':>7}"
        f" {'to ' + format(config.target, '.0%') + ' vs no-delay':>18} {'end vs no-delay':>15}"
    )
    lines = [header]
    for arm in arms:
        to_target, to_end = "", ""
        reference = base.get(arm.workflow)
        if arm.delays and reference is not None:
            mine, theirs = arm.curve.time_to(config.target), reference.curve.time_to(config.target)
            to_target = "-" if mine is None or theirs is None else f"{(mine - theirs) / 60:+.1f} min"
            to_end = f"{(arm.curve.end_s - reference.curve.end_s) / 60:+.1f} min"
        line = f"{arm.name:<17}" + "".join(f" {_minutes(arm.curve.time_to(t)):>10}" for t in thresholds)
        line += f" {_minutes(arm.curve.time_held(config.target)):>14}"
        line += (
            f" {arm.curve.final_accuracy:>9.4f} {len(arm.curve.steps) - 1:>6} {arm.updates:>7}"
            f" {arm.dropouts:>5} {arm.curve.end_s / 60:>7.1f} {to_target:>18} {to_end:>15}"
        )
        lines.append(line)
    return "\n".join(lines)


def summary(config: StudyConfig, arms: Sequence[Arm]) -> dict[str, Any]:
    """The numbers, for ``--json`` (and the tests)."""
    return {
        "config": dataclasses.asdict(config),
        "arms": {
            a.name: {
                "time_to_target_s": a.curve.time_to(config.target),
                "time_to_s": {f"{t:.2f}": a.curve.time_to(t) for t in THRESHOLDS},
                "time_held_s": a.curve.time_held(config.target),
                "final_accuracy": a.curve.final_accuracy,
                "models": len(a.curve.steps) - 1,
                "updates": a.updates,
                "dropouts": a.dropouts,
                "end_s": a.curve.end_s,
                "steps": list(a.curve.steps),
                "times_s": list(a.curve.times_s),
                "accuracies": list(a.curve.accuracies),
                **a.extra,
            }
            for a in arms
        },
    }


_COLOURS = {"fedavg": "tab:blue", "fedbuff": "tab:orange"}
_LABELS = {"fedavg": "FedAvg (synchronous)", "fedbuff": "FedBuff (asynchronous)"}


def draw(config: StudyConfig, arms: Sequence[Arm], path: Path) -> None:
    """Held-out accuracy against virtual minutes: a curve per run (no-delay dashed), the target dotted."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8.5, 5.0))
    try:
        for arm in arms:
            minutes = [t / 60 for t in arm.curve.times_s]
            label = _LABELS[arm.workflow] + ("" if arm.delays else ", no delays")
            reached = arm.curve.time_to(config.target)
            if reached is not None:
                label += f": {config.target:.0%} at {reached / 60:.1f} min"
            axis.step(
                minutes,
                arm.curve.accuracies,
                where="post",  # a model holds until the next one is made
                color=_COLOURS[arm.workflow],
                linestyle="-" if arm.delays else "--",
                alpha=1.0 if arm.delays else 0.55,
                linewidth=1.8 if arm.delays else 1.2,
                label=label,
            )
            if reached is not None and arm.delays:
                axis.plot([reached / 60], [config.target], "o", color=_COLOURS[arm.workflow])
        axis.axhline(
            config.target, color="grey", linestyle=":", linewidth=1.2, label=f"target {config.target:.0%}"
        )
        axis.set_xlabel("virtual time (minutes since the job started)")
        axis.set_ylabel("held-out accuracy (fraction correct, 0–1)")
        axis.set_ylim(0.0, 1.0)
        axis.set_xlim(left=0.0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small", loc="lower right")
        hetero = (
            f"compute log-normal median {config.median_compute_s:g} s, σ {config.task_sigma:g}; "
            f"device speed σ {config.speed_sigma:g}; drop-out {config.dropout:.0%}"
        )
        axis.set_title(
            f"FedBuff vs FedAvg on {config.devices} virtual devices (digits, seed {config.seed})\n{hetero}",
            fontsize=11,
        )
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=100)
    finally:
        plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the study; returns the exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = StudyConfig()
    parser.add_argument("--out", type=Path, help="write the plot to this PNG file")
    parser.add_argument("--devices", type=int, default=defaults.devices)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--target", type=float, default=defaults.target, help="held-out accuracy to time")
    parser.add_argument("--time-scale", type=float, default=defaults.time_scale)
    parser.add_argument(
        "--fedavg-timeout",
        type=float,
        default=defaults.round_timeout_s,
        help="FedAvg's round timeout in simulated seconds",
    )
    parser.add_argument(
        "--fedavg-min-results",
        type=int,
        default=defaults.min_results,
        help="results a FedAvg round needs by its timeout",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the two no-delay runs")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON on the last line")
    args = parser.parse_args(argv)
    config = dataclasses.replace(
        defaults,
        devices=args.devices,
        seed=args.seed,
        target=args.target,
        time_scale=args.time_scale,
        round_timeout_s=args.fedavg_timeout,
        devices_per_round=min(defaults.devices_per_round, args.devices),
        min_results=min(args.fedavg_min_results, args.devices),
        selection=min(defaults.selection, args.devices),
    )
    arms = run_study(config, baseline=not args.no_baseline, log=not args.json)
    if args.out is not None:
        draw(config, arms, args.out)
    if args.json:
        print(json.dumps(summary(config, arms)))
    else:
        print(table(config, arms))
        if args.out is not None:
            print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
