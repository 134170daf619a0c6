"""The replica benchmark's quick mode runs end to end on a real PostgreSQL server: one and two replicas
serve the whole fleet, every acknowledged result is counted, the model is delivered intact from both blob
stores, and its own checks hold. Speed is printed by the bench, never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.orphans import tied

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.postgres
@pytest.mark.slow
def test_quick_run_serves_the_fleet_from_one_and_two_replicas(tmp_path: Path, pg_database: str) -> None:
    out = tmp_path / "replica.json"
    # The fixture's database is only where the bench connects to make (and drop) databases of its own.
    command = [sys.executable, "-m", "bench.replica_bench", "--quick", "--json", str(out), "--pg-url"]
    done = subprocess.run(
        tied([*command, pg_database]), capture_output=True, text=True, timeout=540, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checks: all passed" in done.stdout, done.stdout
    assert "targets: " in done.stdout, done.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True
    assert report["checks"] and all(report["checks"].values()), report["checks"]

    devices, rounds = report["config"]["devices"], report["config"]["rounds"]
    [measured] = report["cpu_per_rpc"]
    assert measured["echo"]["mismatches"] == 0 and measured["echo"]["server_cpu_ms_per_call"] > 0
    for replicas in (1, 2):
        run = measured[f"replicas_{replicas}"]
        assert run["replicas"] == replicas and len(run["shares"]) == replicas
        assert sum(run["devices"]) == devices and min(run["devices"]) > 0
        # The bench's own count: every acknowledged result is in a closed round, once.
        assert run["acks"] == devices * rounds == sum(run["job"]["round_results"]), replicas
        assert run["job"]["state"] == "JOB_STATE_FINISHED"
        for share in run["shares"]:
            # Every replica served its devices' RPCs, through all the measured rounds.
            assert share["rounds_in_window"] == rounds - 1 and share["completed_rpcs"] > 0, share
            assert share["outcomes"] == {"DONE": share["spec"]["devices"]} and not share["errors"]
        assert len(run["replica_cpu_ms_per_rpc"]) == replicas
        assert all(cpu > 0 for cpu in run["replica_cpu_ms_per_rpc"]), run["replica_cpu_ms_per_rpc"]
        summed = sum(run["replica_cpu_ms_per_rpc"])
        assert run["coordinator_cpu_ms_per_rpc"] == pytest.approx(summed, abs=0.01)
    assert measured["one_to_echo"] > 0 and measured["two_to_one"] > 0

    [delivery] = report["delivery"]
    for key in ("file_store", "postgres_blobs"):
        result = delivery[key]
        assert result["blobs_in_database"] is (key == "postgres_blobs")
        assert result["downloads"] == report["config"]["downloaders"], key
        assert result["bytes"] == result["downloads"] * result["model_bytes"], key
        assert result["hashed"] == result["downloads"] and result["sha256_match"], key  # quick: every one
    assert delivery["postgres_to_file"] > 0
    medians = report["medians"]
    assert all(value is not None and value > 0 for value in medians.values()), medians


def test_targets_are_judged_from_the_medians() -> None:
    from bench.replica_bench import median, targets

    assert median([1.0, None, 3.0, 2.0]) == 2.0 and median([None]) is None
    medians: dict[str, float | None] = {"one_to_echo": 2.5, "two_to_one": 1.2, "postgres_to_file": 0.5}
    assert targets(medians) == {
        "one_replica_cpu_within_2.5x_echo": True,
        "two_replicas_cpu_within_1.25x_one": True,
        "postgres_blobs_delivery_half_of_file": True,
    }
    medians = {"one_to_echo": 2.6, "two_to_one": 1.3, "postgres_to_file": 0.49}
    assert targets(medians) == {
        "one_replica_cpu_within_2.5x_echo": False,
        "two_replicas_cpu_within_1.25x_one": False,
        "postgres_blobs_delivery_half_of_file": False,
    }
    assert set(targets({}).values()) == {None}  # a run that measured nothing judges nothing
