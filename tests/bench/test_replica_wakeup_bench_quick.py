"""The cross-replica wake-up benchmark's quick mode runs end to end on a real PostgreSQL database and
measures both paths (a device on the other replica, and the baseline device on the driving one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.orphans import tied

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def test_quick_run_measures_both_replicas(tmp_path: Path, pg_database: str) -> None:
    out = tmp_path / "bench.json"
    command = [sys.executable, str(ROOT / "bench" / "replica_wakeup_bench.py"), "--quick", "--json", str(out)]
    done = subprocess.run(
        tied([*command, "--db-url", pg_database]),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "p50 on B / p50 on A" in done.stdout, done.stdout
    figures = json.loads(out.read_text())["figures"]
    assert set(figures) == {"on B (cross-replica)", "on A (baseline)"}
    for name, f in figures.items():
        # Every round gives one sample per device, unless its task existed before its poll began.
        assert f["n"] + f["not_waiting"] == 5, (name, f)
        assert f["n"] >= 1, (name, f)
        assert 0 < f["p50_ms"] <= f["p99_ms"] <= f["max_ms"], (name, f)
