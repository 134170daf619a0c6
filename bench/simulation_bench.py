"""Simulation benchmark: fedlink's ``local`` backend against Flower 1.42's run_simulation, same workload.

Run from the repository root::

    .venv/bin/python -m bench.simulation_bench [--quick] [--json out.json] [--devices 10,100,1000]
        [--floats 10000,1000000] [--rounds 3] [--target-devices 10000] [--no-flower]

The workload (``bench/simulation_workload.py``, the same arithmetic as ``bench/flower_app``): FedAvg,
every device every round, one float32 array, 3 rounds; device i returns ``params + 0.001 * (i + 1)``
with ``num_examples = i + 1``. Both final models are checked against the exact expected value.

Both sides are measured the same way. Each configuration runs in a fresh subprocess that imports
everything first, then times its ``run_simulation`` call to its return (for Flower that includes Ray
starting and stopping; for fedlink the coordinator core, the throwaway SQLite store and the N Runners
starting and stopping; fedlink's record also has ``cleanup_after_return_s``, the removal of the run's
scratch directory, which a background thread finishes after the call returned). This process samples
the subprocess's process tree every 100 ms with Flower's baseline sampler
(``bench.flower_baseline.sample_tree``): ``peak_rss_mb`` is the driver's VmHWM plus the RSS of every
other process of the run (fedlink has none; Flower has Ray's). The fedlink run of
``--target-devices`` × 10,000 floats (default 10,000 devices) runs ``--target-repeats`` times (default
3, each in a fresh subprocess: these machines drift by ±20 % within minutes) and its median wall time
is judged against the 30-s target.

``--quick`` (what the test suite runs): no Flower, 10 and 100 devices × 10,000 floats, no target run.
The run exits 1 if a final model was wrong or a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.flower_baseline import (
    TAG_VARIABLE,
    ProcessTree,
    TreeMemory,
    parse_sizes,
    sample_tree,
)
from bench.orphans import tied
from bench.report import num, targets_line

ROOT = Path(__file__).resolve().parents[1]
RESULT_MARKER = "FEDLINK_SIM_RESULT "
SAMPLE_INTERVAL_S = 0.1
PSS_EVERY = 20
#: Issue 5's targets.
WALL_RATIO_TARGET = 10.0
MEMORY_RATIO_TARGET = 0.25
MEMORY_TARGET_SIZE = (1000, 1_000_000)
TARGET_FLOATS = 10_000
TARGET_WALL_S = 30.0


# ---------------------------------------------------------------- the child: one fedlink run


def _child(devices: int, floats: int, rounds: int) -> dict[str, Any]:
    """Runs fedlink's simulation once (imports first, then the timed call) and checks the final model."""
    from bench.simulation_workload import benchmark_job, check_model, registry
    from fedlink.simulation import run_simulation

    job, app = benchmark_job(floats, rounds), registry()
    record: dict[str, Any] = {"devices": devices, "floats": floats, "rounds": rounds, "ok": False}
    started = time.perf_counter()
    try:
        result = run_simulation(job, devices, runner=app, backend="local")
    except Exception as exc:  # reported on the result line: the parent records the failure
        record |= {"wall_s": time.perf_counter() - started, "error": f"{type(exc).__name__}: {exc}"}
        return record
    wall = time.perf_counter() - started
    # The run's scratch directory is removed in a background thread after the call returned: timed
    # here separately, so that no cost is hidden (the process waits for it at exit anyway).
    for thread in threading.enumerate():
        if thread.name == "fedlink-sim-cleanup":
            thread.join()
    record |= {
        "wall_s": wall,
        "cleanup_after_return_s": time.perf_counter() - started - wall,
        "setup_s": result.setup_s,
        "round_s": [r.duration_s for r in result.rounds],
        "round_results": [r.num_results for r in result.rounds],
    }
    try:
        if record["round_results"] != [devices] * rounds:
            raise ValueError(f"results per round {record['round_results']}, expected {[devices] * rounds}")
        record["max_abs_error"] = check_model(dict(result.arrays), devices, floats, rounds)
        record["ok"] = True
    except ValueError as exc:
        record["error"] = str(exc)
    return record


# ---------------------------------------------------------------- the parent: measure one run


def run_fedlink(devices: int, floats: int, rounds: int, timeout_s: float) -> dict[str, Any]:
    """Runs one configuration on fedlink in a fresh subprocess, sampling its process tree's memory.

    Returns:
        ``{devices, floats, rounds, wall_s, peak_rss_mb, peak_pss_mb, ok, error?, ...}``; a failure
        (timeout, crash, wrong model) has ``ok`` false and ``error`` saying why.
    """
    tag = uuid.uuid4().hex
    env = os.environ | {TAG_VARIABLE: tag, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "bench.simulation_bench", "--child"]
    command += [f"--devices={devices}", f"--floats={floats}", f"--rounds={rounds}"]
    memory = TreeMemory()
    load_before = os.getloadavg()[0]
    record: dict[str, Any] = {"devices": devices, "floats": floats, "rounds": rounds, "ok": False}
    with tempfile.TemporaryDirectory(prefix="fedlink-sim-bench-") as scratch:
        out_path, err_path = Path(scratch) / "stdout", Path(scratch) / "stderr"
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            process = subprocess.Popen(tied(command), stdout=out, stderr=err, env=env, cwd=ROOT)
        tree = ProcessTree(process.pid, tag)
        deadline = time.monotonic() + timeout_s
        while process.poll() is None:
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                record["error"] = f"timed out after {timeout_s:g} s"
                break
            sample_tree(tree, memory, with_pss=memory.samples % PSS_EVERY == 0)
            time.sleep(SAMPLE_INTERVAL_S)
        lines = [x for x in out_path.read_text().splitlines() if x.startswith(RESULT_MARKER)]
        if lines:
            record |= json.loads(lines[-1][len(RESULT_MARKER) :])
        elif "error" not in record:
            tail = err_path.read_text(errors="replace")[-1500:].strip()
            record["error"] = f"exit status {process.returncode}, no result line; stderr: {tail}"
    record |= {
        "peak_rss_mb": round(memory.peak_rss_bytes / 2**20, 1),
        "peak_pss_mb": round(memory.peak_pss_bytes / 2**20, 1),
        "max_processes": memory.max_processes,
        "memory_samples": memory.samples,
        "load_avg_1m_before": load_before,
    }
    return record


def _flower(devices: int, floats: int, rounds: int, timeout_s: float) -> dict[str, Any]:
    from bench.flower_baseline import run_flower

    return run_flower(devices, floats, rounds, timeout_s)


# ---------------------------------------------------------------- the report


def _ratio(numerator: object, denominator: object) -> float | None:
    if isinstance(numerator, int | float) and isinstance(denominator, int | float) and denominator > 0:
        return float(numerator) / float(denominator)
    return None


def pair(fedlink: dict[str, Any], flower: dict[str, Any] | None) -> dict[str, Any]:
    """One row of the comparison: both records and the two ratios (None where a side is missing)."""
    ok_flower = flower is not None and flower.get("ok") is True
    return {
        "devices": fedlink["devices"],
        "floats": fedlink["floats"],
        "fedlink": fedlink,
        "flower": flower,
        # Flower ÷ fedlink wall time (≥ 10 is the target) and fedlink ÷ Flower memory (≤ 0.25).
        "wall_ratio": _ratio(flower["wall_s"], fedlink.get("wall_s")) if ok_flower and flower else None,
        "memory_ratio": _ratio(fedlink.get("peak_rss_mb"), flower["peak_rss_mb"])
        if ok_flower and flower
        else None,
    }


def _ratio_text(value: object) -> str:
    return num(value, ".1f") + "x" if isinstance(value, int | float) else "-"


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The comparison as a plain-text table, one line per configuration."""
    header = (
        f"{'devices':>7} {'floats':>9} | {'fedlink s':>9} {'Flower s':>9} {'Flower/fl':>9} | "
        f"{'fedlink MB':>10} {'Flower MB':>10} {'fl/Flower':>9} | ok"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        fl, fw = row["fedlink"], row["flower"] or {}
        problems = [
            f"{side}: {r['error'][:80]}" for side, r in (("fedlink", fl), ("Flower", fw)) if r.get("error")
        ]
        lines.append(
            f"{row['devices']:>7} {row['floats']:>9} | {num(fl.get('wall_s'), '9.2f')} "
            f"{num(fw.get('wall_s'), '9.2f')} {_ratio_text(row['wall_ratio']):>9} | "
            f"{num(fl.get('peak_rss_mb'), '10.0f')} {num(fw.get('peak_rss_mb'), '10.0f')} "
            f"{num(row['memory_ratio'], '9.3f')} | {'; '.join(problems) or 'yes'}"
        )
    return "\n".join(lines)


def median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median wall time, with every run's wall time beside it; a failed run fails it."""
    walls = [r.get("wall_s") for r in runs]
    failed = [r for r in runs if not r["ok"]]
    chosen = failed[0] if failed else sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]
    return chosen | {"wall_s_runs": walls}


def targets(rows: Sequence[dict[str, Any]], target_run: dict[str, Any] | None) -> dict[str, bool | None]:
    """Which of issue 5's targets the figures meet (None: not measured in this run)."""
    compared = [r for r in rows if r["wall_ratio"] is not None]
    wall: bool | None = None
    if compared:
        wall = len(compared) == len(rows) and all(r["wall_ratio"] >= WALL_RATIO_TARGET for r in compared)
    memory: bool | None = None
    for row in rows:
        if (row["devices"], row["floats"]) == MEMORY_TARGET_SIZE and row["memory_ratio"] is not None:
            memory = row["memory_ratio"] <= MEMORY_RATIO_TARGET
    big: bool | None = None
    if target_run is not None:
        big = bool(target_run.get("ok")) and target_run["wall_s"] < TARGET_WALL_S
    return {"wall_10x_every_size": wall, "memory_quarter_at_1000x1M": memory, "10000x10k_under_30s": big}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the grid (fedlink, then Flower, per configuration) and the 10,000-device run; prints the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="no Flower; 10 and 100 devices x 10,000 floats")
    parser.add_argument("--devices", type=parse_sizes, default=None, help="default 10,100,1000")
    parser.add_argument("--floats", type=parse_sizes, default=None, help="default 10000,1000000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--target-devices", type=int, default=None, help="default 10000; 0 skips it")
    parser.add_argument("--target-repeats", type=int, default=3, help="runs of the target size (median)")
    parser.add_argument("--no-flower", action="store_true", help="fedlink only")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        (devices,), (floats,) = args.devices, args.floats
        print(RESULT_MARKER + json.dumps(_child(devices, floats, args.rounds)), flush=True)
        return 0
    devices = args.devices or ([10, 100] if args.quick else [10, 100, 1000])
    floats = args.floats or ([10_000] if args.quick else [10_000, 1_000_000])
    target_devices = args.target_devices if args.target_devices is not None else (0 if args.quick else 10_000)
    with_flower = not (args.quick or args.no_flower)
    report: dict[str, Any] = {"config": {**vars(args), "json": str(args.json), "cpus": os.cpu_count()}}
    rows: list[dict[str, Any]] = []
    target_run: dict[str, Any] | None = None

    def save() -> None:
        # Written after every configuration: a long grid killed half-way keeps what it measured.
        report.update(rows=rows, target_run=target_run, targets=targets(rows, target_run))
        report["ok"] = all(r["fedlink"]["ok"] for r in rows) and (target_run is None or target_run["ok"])
        if args.json is not None:
            args.json.write_text(json.dumps(report, indent=2) + "\n")

    for size in floats:
        for count in devices:
            fedlink = run_fedlink(count, size, args.rounds, args.timeout)
            print("fedlink", json.dumps(fedlink), flush=True)
            flower = _flower(count, size, args.rounds, args.timeout) if with_flower else None
            if flower is not None:
                print("Flower ", json.dumps(flower), flush=True)
            rows.append(pair(fedlink, flower))
            save()
    if target_devices:
        runs = []
        for _ in range(max(1, args.target_repeats)):
            runs.append(run_fedlink(target_devices, TARGET_FLOATS, args.rounds, args.timeout))
            print("fedlink", json.dumps(runs[-1]), flush=True)
        target_run = median_run(runs)
    save()
    print()
    print(format_table(rows))
    if target_run is not None:
        print(
            f"\nfedlink {target_devices} devices x {TARGET_FLOATS} floats x {args.rounds} rounds: "
            f"median {num(target_run.get('wall_s'), '.1f')} s of "
            f"{', '.join(num(w, '.1f') for w in target_run['wall_s_runs'])} "
            f"(target < {TARGET_WALL_S:.0f} s), "
            f"peak RSS {num(target_run.get('peak_rss_mb'), '.0f')} MB"
            + ("" if target_run["ok"] else f", FAILED: {target_run.get('error')}")
        )
    print(targets_line(report["targets"]))
    print("model checks:", "all passed" if report["ok"] else "FAILED")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
