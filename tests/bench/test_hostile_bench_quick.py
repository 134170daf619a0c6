"""The hostile-fleet benchmark's quick mode runs end to end, measures every figure, and its checks hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.orphans import tied

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_run_measures_the_flood_and_enrolment_and_passes_its_checks(tmp_path: Path) -> None:
    out = tmp_path / "hostile.json"
    done = subprocess.run(
        tied([sys.executable, "-m", "bench.hostile_bench", "--quick", "--json", str(out)]),
        capture_output=True,
        text=True,
        timeout=540,  # below the slow tests' 600 s ceiling (tests/conftest.py)
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checks: all passed" in done.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True and all(report["checks"].values()), report["checks"]

    flood = report["flood"]
    kinds = {"many_tensors", "huge_sparse", "deep_meta", "dense_nan"}
    # Every kind was sent, and every report refused with INVALID_ARGUMENT (the check above).
    assert {key.split("/")[0] for key in flood["outcomes"]} == kinds
    assert all(flood["latency"][kind]["count"] > 0 for kind in kinds)
    assert flood["reports"] == sum(flood["outcomes"].values()) > 0
    for health in (flood["health_baseline"], flood["health_flood"]):
        assert health["count"] > 0 and not health["failures"]
        assert 0 < health["p50_ms"] <= health["p99_ms"] <= health["max_ms"]
    assert 0 < flood["rss_before_mib"] <= flood["rss_peak_mib"]
    assert flood["rss_after_mib"] > 0
    assert flood["assignments_still_open"] == report["config"]["devices"]

    enrolment = report["enrolment"]
    assert enrolment["median_enrolments_per_s"] > 0 and enrolment["echo_calls_per_s"] > 0
    assert len(enrolment["enrolments_per_s"]) == report["config"]["enrol_repeats"]
    assert set(report["targets"]) == {"health_p99_under_100ms", "rss_returns_within_10pct", "rss_bounded"}


def test_targets_are_judged_from_the_figures() -> None:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.hostile_bench import MiB, targets

    flood = {
        "health_flood": {"p99_ms": 40.0},
        "rss_before_mib": 120.0,
        "rss_peak_mib": 200.0,
        "rss_after_mib": 125.0,
        "model_bytes": 16 * MiB,
        "devices": 10,
    }
    assert targets({"flood": flood}) == {
        "health_p99_under_100ms": True,
        "rss_returns_within_10pct": True,
        "rss_bounded": True,
    }
    flood |= {"health_flood": {"p99_ms": 150.0}, "rss_after_mib": 140.0, "rss_peak_mib": 1000.0}
    assert targets({"flood": flood}) == {
        "health_p99_under_100ms": False,
        "rss_returns_within_10pct": False,
        "rss_bounded": False,
    }
    assert set(targets({}).values()) == {None}
