"""The store benchmark's quick mode runs end to end, measures something, and breaks no store invariant."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.orphans import tied

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_run_reports_rates_and_keeps_the_invariants(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        tied([sys.executable, str(ROOT / "bench" / "store_bench.py"), "--quick", "--json", str(out)]),
        capture_output=True,
        text=True,
        timeout=540,  # below the slow tests' 600 s ceiling (tests/conftest.py)
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "claims/s" in done.stdout and "baseline sqlite" in done.stdout
    report = json.loads(out.read_text())

    baselines = report["baselines_insert_tx_per_s"]
    assert "sqlite" in baselines
    assert all(rate > 0 for rate in baselines.values())
    measured = {(r["backend"], r["workers"], r["batch"]) for r in report["runs"]}
    expected = {(b, w, n) for b in baselines for w in (1, 8) for n in (1, 16)}
    assert measured == expected

    for run in report["runs"]:
        name = f"{run['backend']} w={run['workers']} b={run['batch']}"
        assert len(run["windows"]) == round(run["duration_s"] / 0.5), name
        # Positive overall, not per window: on a loaded machine one half-second window may be empty.
        assert sum(w["claims_per_s"] for w in run["windows"]) > 0, name
        assert sum(w["results_per_s"] for w in run["windows"]) > 0, name
        assert run["claims_vs_baseline"] >= 0 and run["results_vs_baseline"] >= 0, name
        assert run["processes"] == (1 if run["backend"] == "sqlite" else run["workers"]), name
        totals, invariants = run["totals"], run["invariants"]
        assert invariants["ok"] is True, (name, invariants)
        assert invariants["slots_held_twice"] == 0, name
        assert invariants["over_slot_tasks"] == 0, name
        assert invariants["foreign_device_claims"] == 0, name
        assert invariants["assignments_with_two_results"] == 0, name
        assert invariants["completed_without_result"] == 0, name
        # What the workers counted is what the database holds: every claim one assignment row,
        # every accepted report one accepted result row.
        assert totals["claims"] == invariants["assignments"], name
        assert totals["results"] == invariants["accepted_results"] > 0, name
        assert totals["errors"] == 0, name
