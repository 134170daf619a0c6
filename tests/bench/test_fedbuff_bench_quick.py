"""The FedBuff-against-FedAvg benchmark's quick mode runs end to end on real coordinator processes: both
jobs finish, every version and round counts what it should, and the CPU figures are there. Speed is
printed by the bench, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.fedbuff_bench import Sizes
from bench.orphans import tied

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_run_measures_both_workflows_and_passes_its_checks(tmp_path: Path) -> None:
    out = tmp_path / "fedbuff.json"
    command = [sys.executable, "-m", "bench.fedbuff_bench", "--quick", "--json", str(out)]
    done = subprocess.run(tied(command), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checks: all passed" in done.stdout and "targets: " in done.stdout, done.stdout
    report = json.loads(out.read_text())
    assert report["checks_failed"] == []
    [run] = report["runs"]
    for workflow in ("fedavg", "fedbuff", "fedavg-sampled"):
        figures = run[workflow]
        assert figures["state"] == "JOB_STATE_FINISHED", workflow
        assert all(figures["checks"].values()), (workflow, figures["checks"])
        assert figures["acks_in_window"] > 0 and figures["cpu_ms_per_update"] > 0, workflow
    assert run["fedbuff"]["versions"] == Sizes(200, 3, 100, 20).versions == 30
    assert run["fedbuff"]["versions_per_s"] > 0
    [row] = report["by_size"].values()
    assert row["ratio"] == pytest.approx(run["ratio"]) and row["ratio"] > 0
    assert row["ratio_to_sampled"] == pytest.approx(run["ratio_to_sampled"]) and row["ratio_to_sampled"] > 0


def test_fedbuffs_run_makes_as_many_updates_as_fedavgs() -> None:
    big = Sizes(10_000, 3, 1000, 100)
    assert (big.selected, big.versions, big.sampled_rounds) == (1000, 300, 30)
    assert (big.fedavg_rounds("fedavg"), big.fedavg_rounds("fedavg-sampled")) == ((3, 10_000), (30, 1000))
    assert big.workflows == ("fedavg", "fedbuff", "fedavg-sampled")
    whole = Sizes(200, 3, 1000, 20)
    assert (whole.selected, whole.versions) == (200, 30)
    assert whole.workflows == ("fedavg", "fedbuff")  # sampling all 200 would be FedAvg's run again
