"""Scale benchmark (issue 16): time per device-round of the simulation from 1,000 to 100,000 devices.

Run from the repository root::

    .venv/bin/python -m bench.scale_bench [--json out.json] [--devices 1000,10000,100000]
        [--floats 10000] [--rounds 3] [--baseline 84ebaf6] [--baseline-timeout 600] [--no-baseline]
        [--fedbuff-devices 100000] [--fedbuff-versions 20] [--fedbuff-selection 1000]

FedAvg: ``bench/simulation_workload.py``'s workload (every device every round, one float32 array of
``--floats``, device i adds ``0.001 (i + 1)``; the final model is checked against the exact value), at
each size, on this tree and on the baseline commit (``git worktree add`` of it in a temporary folder,
removed at the end), one fresh subprocess per run, the baseline's with ``PYTHONPATH`` at its
``runner/``, ``server/``, ``proto/gen/python`` and root. A baseline run longer than
``--baseline-timeout`` is killed and reported as such (at 100,000 devices it did not finish in 20
minutes). Time per device-round is the ``run_simulation`` call's wall time (setup, rounds, stopping the
devices) over ``devices x rounds``; the rounds' own share is beside it.

FedBuff (this tree only): ``--fedbuff-devices`` devices, a selection of ``--fedbuff-selection``,
``--fedbuff-versions`` model versions of ``--fedbuff-updates`` updates each; the time each version
took (the first one includes starting the devices), and the run's peak RSS (the subprocess's VmHWM and
its process tree's, sampled every 100 ms as ``bench/simulation_bench.py`` does).

Then FedBuff's CPU against FedAvg's on a real coordinator process (``bench/fedbuff_bench.py``, one
repeat per ``--cpu-devices`` size by default): coordinator CPU per accepted update, and model versions
per second, at 1,000 and 10,000 devices.

Targets: the time per device-round at every size within 1.5x of the smallest size's, and at most a
third of the baseline's (at each size the baseline finished; ``--target-ms``, default 1.3 / 3 ms, is
the absolute bound of issue 16, judged too); FedBuff's peak RSS under 2 GB and its last version's time
within 1.5x of its second's (the first includes the devices' start); FedBuff's CPU per update at most
1.2 x FedAvg's per result. The run exits 1 if a run failed or a model was wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.orphans import tied

ROOT = Path(__file__).resolve().parents[1]
RESULT_MARKER = "FEDLINK_SCALE_RESULT "
SAMPLE_INTERVAL_S = 0.1
#: Issue 16's targets.
FLAT_RATIO_TARGET = 1.5
SPEEDUP_TARGET = 3.0
TODAY_MS = 1.3
FEDBUFF_RSS_TARGET_MB = 2048.0
#: The package roots a tree's code imports from (pyproject.toml's dev-mode-dirs), and its root (bench).
SOURCE_ROOTS = ("runner", "server", "proto/gen/python", ".")


# ---------------------------------------------------------------- the children: one run each


class _AddDiff:
    """FedBuff's trainer: the update ``0.001 (partition + 1)`` as a WEIGHT_DIFF of one example."""

    def execute(self, dxo: Any, ctx: Any, abort_signal: Any) -> Any:
        from fedlink.common.dxo import DXO, DataKind, MetaKey
        from fedlink.runner.context import ContextKey

        step = np.float32(0.001 * (int(ctx[ContextKey.PARTITION_ID]) + 1))
        diff = {name: np.full(array.shape, step, array.dtype) for name, array in dxo.data.items()}
        return DXO(kind=DataKind.WEIGHT_DIFF, data=diff, meta={MetaKey.NUM_EXAMPLES: 1})


def _fedavg_child(devices: int, floats: int, rounds: int) -> dict[str, Any]:
    """One FedAvg run of the simulation benchmark's workload (imports first, then the timed call)."""
    from bench.simulation_workload import benchmark_job, check_model, registry
    from fedlink.simulation import run_simulation

    job, app = benchmark_job(floats, rounds), registry()
    record: dict[str, Any] = {"ok": False}
    started = time.perf_counter()
    result = run_simulation(job, devices, runner=app, backend="local")
    wall = time.perf_counter() - started
    round_s = [r.duration_s for r in result.rounds]
    record |= {"wall_s": wall, "setup_s": result.setup_s, "round_s": round_s}
    record["round_results"] = [r.num_results for r in result.rounds]
    if record["round_results"] != [devices] * rounds:
        record["error"] = f"results per round {record['round_results']}, expected {[devices] * rounds}"
        return record
    record["max_abs_error"] = check_model(dict(result.arrays), devices, floats, rounds)
    record["ok"] = True
    return record


def _fedbuff_child(devices: int, floats: int, versions: int, selection: int, updates: int) -> dict[str, Any]:
    """One FedBuff run: ``versions`` versions of ``updates`` updates, a selection of ``selection``."""
    from fedlink.server.workflows.fedbuff import FedBuffParams
    from fedlink.simulation import SimulationJob, run_simulation

    params = FedBuffParams(
        max_model_version=versions,
        device_selection_size=selection,
        num_updates_for_model=updates,
        max_model_history=versions,
        keep_checkpoints=1,
        seed=1,
    )
    job = SimulationJob(name="bench-fedbuff", workflow=params, model={"w": np.zeros(floats, np.float32)})
    started = time.perf_counter()
    result = run_simulation(job, devices, runner=_AddDiff(), backend="local")
    wall = time.perf_counter() - started
    version_s = [r.duration_s for r in result.rounds]
    record: dict[str, Any] = {"wall_s": wall, "setup_s": result.setup_s, "version_s": version_s}
    record["ok"] = len(version_s) == versions and all(r.num_results >= updates for r in result.rounds)
    if not record["ok"]:
        record["error"] = f"{len(version_s)} versions, updates {[r.num_results for r in result.rounds]}"
    return record


# ---------------------------------------------------------------- the parent: measure one run


def _environment(tree: Path) -> dict[str, str]:
    path = os.pathsep.join(str(tree / root) for root in SOURCE_ROOTS)
    return os.environ | {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def measure(tree: Path, child_args: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """Runs this file's child on ``tree``'s code in a fresh subprocess, sampling its memory.

    Returns:
        The child's record with ``peak_rss_mb``; a timeout or crash has ``ok`` false and ``error``.
    """
    from bench.flower_baseline import TAG_VARIABLE, ProcessTree, TreeMemory, sample_tree

    tag = uuid.uuid4().hex
    env = _environment(tree) | {TAG_VARIABLE: tag}
    # By path, not -m: the baseline's tree has no bench/scale_bench.py, and its packages come first.
    command = [sys.executable, str(Path(__file__).resolve()), "--child", *child_args]
    memory = TreeMemory()
    record: dict[str, Any] = {"ok": False}
    with tempfile.TemporaryDirectory(prefix="fedlink-scale-bench-") as scratch:
        out_path, err_path = Path(scratch) / "stdout", Path(scratch) / "stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            process = subprocess.Popen(tied(command), stdout=out, stderr=err, env=env, cwd=tree)
        tree_of = ProcessTree(process.pid, tag)
        deadline = time.monotonic() + timeout_s
        while process.poll() is None:
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                record["error"] = f"timed out after {timeout_s:g} s"
                record["timed_out"] = True
                break
            sample_tree(tree_of, memory, with_pss=False)
            time.sleep(SAMPLE_INTERVAL_S)
        lines = [x for x in out_path.read_text().splitlines() if x.startswith(RESULT_MARKER)]
        if lines:
            record |= json.loads(lines[-1][len(RESULT_MARKER) :])
        elif "error" not in record:
            tail = err_path.read_text(errors="replace")[-1500:].strip()
            record["error"] = f"exit status {process.returncode}, no result line; stderr: {tail}"
    record["peak_rss_mb"] = round(memory.peak_rss_bytes / 2**20, 1)
    return record


def fedavg_row(tree: Path, devices: int, floats: int, rounds: int, timeout_s: float) -> dict[str, Any]:
    """One FedAvg measurement with its time per device-round (wall, and the rounds' own)."""
    args = ["fedavg", f"--devices={devices}", f"--floats={floats}", f"--rounds={rounds}"]
    record = measure(tree, args, timeout_s) | {"devices": devices, "floats": floats, "rounds": rounds}
    device_rounds = devices * rounds
    if record.get("ok"):
        record["ms_per_device_round"] = 1000 * record["wall_s"] / device_rounds
        record["round_ms_per_device_round"] = 1000 * sum(record["round_s"]) / device_rounds
    elif record.get("timed_out"):  # a lower bound: it took at least this long
        record["ms_per_device_round_at_least"] = 1000 * timeout_s / device_rounds
    return record


# ---------------------------------------------------------------- the report


def targets(
    current: Sequence[dict[str, Any]],
    baseline: Sequence[dict[str, Any]],
    fedbuff: dict[str, Any] | None,
    target_ms: float,
) -> dict[str, bool | None]:
    """Which of issue 16's targets the figures meet (None: not measured)."""
    times = [r.get("ms_per_device_round") for r in current]
    measured = [t for t in times if isinstance(t, float)]
    flat: bool | None = None
    if measured:
        flat = len(measured) == len(times) and max(measured) <= FLAT_RATIO_TARGET * min(measured)
    speedup: bool | None = None
    pairs = []
    for mine, base in zip(current, baseline, strict=False):
        ours = mine.get("ms_per_device_round")
        theirs = base.get("ms_per_device_round", base.get("ms_per_device_round_at_least"))
        if isinstance(ours, float) and isinstance(theirs, float):
            pairs.append(theirs / ours)
    if pairs:
        speedup = all(p >= SPEEDUP_TARGET for p in pairs)
    absolute = all(t <= target_ms for t in measured) and len(measured) == len(times) if measured else None
    buff_rss: bool | None = None
    buff_flat: bool | None = None
    if fedbuff is not None:
        buff_rss = bool(fedbuff.get("ok")) and fedbuff["peak_rss_mb"] < FEDBUFF_RSS_TARGET_MB
        steps = fedbuff.get("version_s") or []
        if fedbuff.get("ok") and len(steps) >= 3:
            buff_flat = steps[-1] <= FLAT_RATIO_TARGET * statistics.median(steps[1:])
    return {
        "fedavg_flat_1.5x": flat,
        "fedavg_third_of_baseline": speedup,
        f"fedavg_under_{target_ms:.2f}ms": absolute,
        "fedbuff_rss_under_2GB": buff_rss,
        "fedbuff_versions_flat_1.5x": buff_flat,
    }


def format_table(current: Sequence[dict[str, Any]], baseline: Sequence[dict[str, Any]]) -> str:
    """FedAvg, both trees, one line per size."""
    from bench.report import num  # the parent's only: a child runs on the baseline's bench package

    header = (
        f"{'devices':>8} | {'now ms/dr':>9} {'rounds ms':>9} {'wall s':>7} {'RSS MB':>7} | "
        f"{'base ms/dr':>10} {'wall s':>7} {'RSS MB':>7} | {'base/now':>8}"
    )
    lines = [header, "-" * len(header)]
    by_size = {r["devices"]: r for r in baseline}
    for mine in current:
        base = by_size.get(mine["devices"], {})
        base_ms = base.get("ms_per_device_round")
        base_text = num(base_ms, "10.3f")
        if base.get("timed_out"):
            base_text = f">{base['ms_per_device_round_at_least']:.3f}".rjust(10)
        ratio = base_ms if isinstance(base_ms, float) else base.get("ms_per_device_round_at_least")
        ours = mine.get("ms_per_device_round")
        speedup = ratio / ours if isinstance(ratio, float) and isinstance(ours, float) else None
        rounds_ms = mine.get("round_ms_per_device_round")
        lines.append(
            f"{mine['devices']:>8} | {num(ours, '9.3f')} {num(rounds_ms, '9.3f')} "
            f"{num(mine.get('wall_s'), '7.1f')} {num(mine.get('peak_rss_mb'), '7.0f')} | "
            f"{base_text} {num(base.get('wall_s'), '7.1f')} {num(base.get('peak_rss_mb'), '7.0f')} | "
            f"{(num(speedup, '.2f') + 'x') if speedup else '-':>8}"
            + ("" if mine.get("ok") else f"  FAILED: {mine.get('error', '')[:100]}")
        )
    return "\n".join(lines)


def _worktree(commit: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="fedlink-scale-base-"))
    folder.rmdir()
    subprocess.run(
        tied(["git", "worktree", "add", "--detach", str(folder), commit]),
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return folder


def _remove_worktree(folder: Path) -> None:
    subprocess.run(tied(["git", "worktree", "remove", "--force", str(folder)]), cwd=ROOT, check=False)


def _sizes(text: str) -> list[int]:
    return [int(part.replace("_", "")) for part in text.split(",") if part.strip()]


def _child(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("workflow", choices=("fedavg", "fedbuff"))
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--floats", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--versions", type=int, default=20)
    parser.add_argument("--selection", type=int, default=1000)
    parser.add_argument("--updates", type=int, default=100)
    args = parser.parse_args(argv)
    if args.workflow == "fedavg":
        record = _fedavg_child(args.devices, args.floats, args.rounds)
    else:
        record = _fedbuff_child(args.devices, args.floats, args.versions, args.selection, args.updates)
    print(RESULT_MARKER + json.dumps(record), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs FedAvg at every size on both trees, then FedBuff, then FedBuff's CPU against FedAvg's on
    a real coordinator; prints the table and the targets."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    # The parent's only: a child runs on the baseline's bench package, which may have neither.
    from bench import fedbuff_bench
    from bench.report import num, targets_line

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--devices", type=_sizes, default=[1000, 10_000, 100_000])
    parser.add_argument("--floats", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", default="84ebaf6", help="the commit measured as today's code")
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument("--baseline-timeout", type=float, default=600.0, help="seconds per baseline run")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run of this tree")
    parser.add_argument("--fedbuff-devices", type=int, default=100_000, help="0 skips FedBuff")
    parser.add_argument("--fedbuff-versions", type=int, default=20)
    parser.add_argument("--fedbuff-selection", type=int, default=1000)
    parser.add_argument("--fedbuff-updates", type=int, default=100)
    parser.add_argument("--target-ms", type=float, default=TODAY_MS / SPEEDUP_TARGET)
    parser.add_argument(
        "--cpu-devices",
        type=lambda text: _sizes(text) if text else [],
        default=[1000, 10_000],
        help="fleet sizes of bench/fedbuff_bench.py's CPU comparison ('' skips it)",
    )
    parser.add_argument("--cpu-repeats", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"config": {**vars(args), "json": str(args.json), "cpus": os.cpu_count()}}
    current: list[dict[str, Any]] = []
    baseline: list[dict[str, Any]] = []
    fedbuff: dict[str, Any] | None = None
    cpu: dict[str, Any] | None = None

    def save() -> None:
        report.update(fedavg=current, baseline=baseline, fedbuff=fedbuff, cpu=cpu)
        report["targets"] = targets(current, baseline, fedbuff, args.target_ms) | (cpu or {}).get(
            "targets", {}
        )
        report["ok"] = (
            all(r.get("ok") for r in current)
            and (fedbuff is None or bool(fedbuff.get("ok")))
            and (cpu is None or not cpu["checks_failed"])
        )
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=2) + "\n")

    base_tree = None if args.no_baseline else _worktree(args.baseline)
    try:
        for devices in args.devices:
            current.append(fedavg_row(ROOT, devices, args.floats, args.rounds, args.timeout))
            print("now ", json.dumps(current[-1]), flush=True)
            if base_tree is not None:
                baseline.append(
                    fedavg_row(base_tree, devices, args.floats, args.rounds, args.baseline_timeout)
                    | {"commit": args.baseline}
                )
                print("base", json.dumps(baseline[-1]), flush=True)
            save()
    finally:
        if base_tree is not None:
            _remove_worktree(base_tree)
    if args.fedbuff_devices:
        child = [
            "fedbuff",
            f"--devices={args.fedbuff_devices}",
            f"--floats={args.floats}",
            f"--versions={args.fedbuff_versions}",
            f"--selection={args.fedbuff_selection}",
            f"--updates={args.fedbuff_updates}",
        ]
        fedbuff = measure(ROOT, child, args.timeout) | {"devices": args.fedbuff_devices}
        print("fedbuff", json.dumps(fedbuff), flush=True)
    if args.cpu_devices:
        sizes = [
            fedbuff_bench.Sizes(d, args.rounds, args.fedbuff_selection, args.fedbuff_updates)
            for d in args.cpu_devices
        ]
        with tempfile.TemporaryDirectory(prefix="fedlink-scale-cpu-") as folder:
            cpu = asyncio.run(fedbuff_bench.measure(sizes, args.cpu_repeats, Path(folder)))
    save()
    print()
    print(f"FedAvg, {args.floats} float32 x {args.rounds} rounds; baseline {args.baseline}")
    print(format_table(current, baseline))
    if fedbuff is not None:
        steps = fedbuff.get("version_s") or []
        print(
            f"\nFedBuff {args.fedbuff_devices} devices, selection {args.fedbuff_selection}, "
            f"{args.fedbuff_versions} versions x {args.fedbuff_updates} updates: wall "
            f"{num(fedbuff.get('wall_s'), '.1f')} s, peak RSS {num(fedbuff.get('peak_rss_mb'), '.0f')} MB, "
            f"s per version first {num(steps[0] if steps else None, '.2f')}, "
            f"second {num(steps[1] if len(steps) > 1 else None, '.2f')}, "
            f"median {num(statistics.median(steps) if steps else None, '.2f')}, "
            f"last {num(steps[-1] if steps else None, '.2f')}"
            + ("" if fedbuff.get("ok") else f"; FAILED: {fedbuff.get('error')}")
        )
    if cpu is not None:
        print("\nCoordinator CPU per accepted update, FedBuff against FedAvg (bench/fedbuff_bench.py):")
        print(fedbuff_bench.summary(cpu).rsplit("\ntargets:", 1)[0])
    print(targets_line(report["targets"]))
    print("runs:", "all passed" if report["ok"] else "FAILED")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
