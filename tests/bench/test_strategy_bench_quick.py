"""The strategy benchmark's quick mode runs end to end, measures every figure, and its checks can fail."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.orphans import tied

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    # bench/ holds scripts run from the repository root (python -m bench.X), not an installed package.
    sys.path.insert(0, str(ROOT))
bench = importlib.import_module("bench.strategy_bench")


@pytest.mark.slow
def test_quick_run_measures_every_strategy_and_rule(tmp_path: Path) -> None:
    out = tmp_path / "strategy.json"
    done = subprocess.run(
        tied([sys.executable, "-m", "bench.strategy_bench", "--quick", "--json", str(out)]),
        capture_output=True,
        text=True,
        timeout=540,  # below the slow tests' 600 s ceiling (tests/conftest.py)
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checks: all passed" in done.stdout
    lines = done.stdout.splitlines()
    for name in ("FedAvg", "FedAvgM", "FedAdam"):
        assert any(line.startswith(f"{name} ") for line in lines), name
    for rule in ("median", "trimmed_mean", "krum"):
        for side in ("fedlink", "numpy"):
            assert any(line.split()[:2] == [rule, side] for line in lines if line.strip()), (rule, side)
    assert any(line.startswith("targets: ") for line in lines)

    report = json.loads(out.read_text())
    assert report["ok"] is True
    assert report["config"] | {"devices": 8, "floats": 20_000, "repeats": 1} == report["config"]
    for name, row in report["steps"]["strategies"].items():
        assert row["fold_s"] > 0 and row["step_s"] > 0 and row["round_s"] > 0, name
        assert row["ratio_to_fedavg"] > 0, name
    assert 0 <= report["steps"]["fedavg_check_worst_in_tolerance"] <= 1
    robust = report["robust"]
    assert robust["bound_models"] == 9 and robust["model_bytes"] == 80_000
    assert robust["memory_judged"] is False  # an 80 kB model: too small to judge memory by
    for rule, row in robust["rules"].items():
        assert row["time_ratio"] > 0 and 0 <= row["check_worst_in_tolerance"] <= 1, rule
        for side in ("fedlink", "numpy"):
            figures = row[side]
            assert figures["seconds"] > 0 and figures["peak_mib"] > 0, (rule, side)
            assert figures["peak_models"] == pytest.approx(figures["peak_mib"] * 2**20 / 80_000)
            assert 0 < figures["close_peak_models"] <= figures["peak_models"], (rule, side)
    # Judged from the figures, whatever they are (timings are not tests): every target has a verdict
    # but the memory targets, which this size does not judge.
    verdicts = report["targets"]
    assert len(verdicts) == 8
    assert all(isinstance(v, bool) for k, v in verdicts.items() if "peak" not in k)
    assert all(v is None for k, v in verdicts.items() if "peak" in k)


def test_the_check_refuses_a_result_of_another_rule() -> None:
    rng = np.random.default_rng(3)
    stack = (rng.standard_normal((9, 1000)) * 0.01).astype(np.float32)
    weights = np.arange(1, 10, dtype=np.float64)
    max_abs = float(np.abs(stack).max())
    median = bench.numpy_median(stack, weights, 1)
    # The same values in float64: within float32 rounding.
    assert bench.check_close("median", median.astype(np.float64), median, rows=9, max_abs=max_abs) <= 1
    with pytest.raises(bench.CheckFailed, match="off by"):
        bench.check_close("median", stack.mean(axis=0), median, rows=9, max_abs=max_abs)
    with pytest.raises(bench.CheckFailed, match="off by"):
        trimmed = bench.numpy_trimmed_mean(stack, weights, 1)
        bench.check_close("trimmed mean", median, trimmed, rows=9, max_abs=max_abs)
    with pytest.raises(bench.CheckFailed, match="shape"):
        bench.check_close("median", median[:-1], median, rows=9, max_abs=max_abs)


def test_the_numpy_krum_chooses_the_update_nearest_the_others() -> None:
    rng = np.random.default_rng(4)
    stack = (rng.standard_normal((10, 500)) * 0.01).astype(np.float32)
    stack[7] *= 0.1  # nearest to every other update
    stack[:2] *= 30.0  # the two attackers
    chosen = bench.numpy_krum(stack, np.ones(10), 2)
    np.testing.assert_array_equal(chosen, stack[7].astype(np.float64))


def test_targets_are_judged_from_the_figures() -> None:
    def rule(ratio: float, close_peak_models: float) -> dict[str, object]:
        # The peak with the making of the updates is not judged: only the close's.
        return {
            "time_ratio": ratio,
            "fedlink": {"peak_models": 500.0, "close_peak_models": close_peak_models},
        }

    report: dict[str, Any] = {
        "steps": {"strategies": {"FedAvgM": {"ratio_to_fedavg": 1.1}, "FedAdam": {"ratio_to_fedavg": 1.6}}},
        "robust": {
            "bound_models": 101,
            "memory_judged": True,
            "rules": {"median": rule(0.9, 104.0), "trimmed_mean": rule(1.2, 100.5), "krum": rule(1.0, 101.0)},
        },
    }
    assert bench.targets(report) == {
        "fedavgm_round_within_1.5x_fedavg": True,
        "fedadam_round_within_1.5x_fedavg": False,
        "median_no_slower_than_numpy": True,
        "trimmed_mean_no_slower_than_numpy": False,
        "krum_no_slower_than_numpy": True,
        "median_peak_within_bound": False,
        "trimmed_mean_peak_within_bound": True,
        "krum_peak_within_bound": True,
    }
    report["robust"]["memory_judged"] = False
    assert bench.targets(report)["median_peak_within_bound"] is None
    assert set(bench.targets({"steps": None, "robust": None}).values()) == {None}
