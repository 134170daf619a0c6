"""The simulation benchmark's quick mode runs end to end and checks its final models; the checks can fail."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.orphans import tied

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    # bench/ holds scripts run from the repository root (python -m bench.X), not an installed package.
    sys.path.insert(0, str(ROOT))
run_config = importlib.import_module("bench.flower_app.run_config")
sim_bench = importlib.import_module("bench.simulation_bench")
workload = importlib.import_module("bench.simulation_workload")


@pytest.mark.slow
def test_quick_run_measures_both_sizes_and_its_models_are_right(tmp_path: Path) -> None:
    out = tmp_path / "simulation.json"
    done = subprocess.run(
        tied([sys.executable, "-m", "bench.simulation_bench", "--quick", "--json", str(out)]),
        capture_output=True,
        text=True,
        timeout=540,  # below the slow tests' 600 s ceiling (tests/conftest.py)
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "model checks: all passed" in done.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True and report["target_run"] is None
    assert [(r["devices"], r["floats"]) for r in report["rows"]] == [(10, 10_000), (100, 10_000)]
    for row in report["rows"]:
        run = row["fedlink"]
        assert run["ok"] is True and "error" not in run
        assert run["round_results"] == [row["devices"]] * 3
        assert 0 <= run["max_abs_error"] < 1e-3
        assert 0 < run["setup_s"] < run["wall_s"]
        # The sampled process tree is the fedlink subprocess: at least the interpreter with numpy.
        assert run["peak_rss_mb"] > 30 and run["memory_samples"] >= 1
        assert row["flower"] is None and row["wall_ratio"] is None
    assert report["targets"] == {
        "wall_10x_every_size": None,
        "memory_quarter_at_1000x1M": None,
        "10000x10k_under_30s": None,
    }


def test_the_model_check_refuses_a_model_that_ignores_the_weights() -> None:
    devices, floats, rounds = 10, 1000, 3
    right = workload.expected_model(run_config.initial_model(floats), devices, rounds).astype(np.float32)
    assert workload.check_model({run_config.MODEL_KEY: right}, devices, floats, rounds) < 1e-5
    # An unweighted mean of the steps: 0.001 * (N + 1) / 2 per round instead of 0.001 * (2N + 1) / 3.
    unweighted = run_config.initial_model(floats) + np.float32(rounds * 0.001 * (devices + 1) / 2)
    with pytest.raises(ValueError, match="off by"):
        workload.check_model({run_config.MODEL_KEY: unweighted}, devices, floats, rounds)
    with pytest.raises(ValueError, match="expected"):
        workload.check_model({run_config.MODEL_KEY: right[:-1]}, devices, floats, rounds)


def test_targets_are_judged_from_the_ratios() -> None:
    fedlink = {"devices": 1000, "floats": 1_000_000, "wall_s": 10.0, "peak_rss_mb": 1000.0, "ok": True}
    flower = {"wall_s": 120.0, "peak_rss_mb": 8000.0, "ok": True}
    row = sim_bench.pair(fedlink, flower)
    assert row["wall_ratio"] == 12.0 and row["memory_ratio"] == 0.125
    slow = sim_bench.pair({**fedlink, "devices": 10, "floats": 10_000, "wall_s": 20.0}, flower)
    met = sim_bench.targets([row], {"ok": True, "wall_s": 29.0})
    assert met == {
        "wall_10x_every_size": True,
        "memory_quarter_at_1000x1M": True,
        "10000x10k_under_30s": True,
    }
    missed = sim_bench.targets([row, slow], {"ok": True, "wall_s": 31.0})
    assert missed == {
        "wall_10x_every_size": False,
        "memory_quarter_at_1000x1M": True,
        "10000x10k_under_30s": False,
    }
    assert sim_bench.pair(fedlink, {**flower, "ok": False})["wall_ratio"] is None


def test_the_target_size_is_judged_by_its_median_run_and_any_failure_fails_it() -> None:
    runs = [{"ok": True, "wall_s": w} for w in (31.0, 22.0, 25.0)]
    chosen = sim_bench.median_run(runs)
    assert chosen["wall_s"] == 25.0 and chosen["wall_s_runs"] == [31.0, 22.0, 25.0]
    assert sim_bench.targets([], chosen)["10000x10k_under_30s"] is True
    slow = sim_bench.median_run([{"ok": True, "wall_s": w} for w in (29.0, 31.0, 33.0)])
    assert slow["wall_s"] == 31.0 and sim_bench.targets([], slow)["10000x10k_under_30s"] is False
    failed = sim_bench.median_run([*runs[:2], {"ok": False, "wall_s": 5.0, "error": "timed out"}])
    assert failed["ok"] is False and sim_bench.targets([], failed)["10000x10k_under_30s"] is False
