"""The runner benchmark's quick mode runs end to end, measures every part, and its own checks hold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.orphans import tied

ROOT = Path(__file__).resolve().parents[2]
TASK_PARTS = ("per_task", "overhead", "get_task", "before_executor", "after_executor", "report")


@pytest.mark.slow
def test_quick_run_measures_overhead_and_upload_and_passes_its_checks(tmp_path: Path) -> None:
    out = tmp_path / "runner.json"
    done = subprocess.run(
        tied([sys.executable, "-m", "bench.runner_bench", "--quick", "--json", str(out)]),
        capture_output=True,
        text=True,
        timeout=540,  # below the slow tests' 600 s ceiling (tests/conftest.py)
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checks: all passed" in done.stdout
    assert "x echo RTT" in done.stdout and "x raw" in done.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True
    config = report["config"]
    rounds, warmup = config["rounds"], config["warmup_tasks"]

    overhead = report["overhead"]
    assert overhead["echo"]["latency"]["count"] == config["echo_calls"]
    assert overhead["echo"]["latency"]["p50_ms"] > 0
    # The echo carries as many bytes as the bare device's ReportResult request.
    assert overhead["echo"]["payload_bytes"] == overhead["bare_device"]["report_payload_bytes"] > 0
    bare, runner = overhead["bare_device"], overhead["runner"]
    for part in (bare, runner):
        # Every task of the job was acknowledged once, and every round closed with that one result.
        assert part["checks"] == {
            "every_task_acknowledged": True,
            "job_finished": True,
            "one_result_per_round": True,
        }
        assert part["job"]["round_results"] == [1] * rounds
        assert part["tasks"] == rounds - warmup
    for name in TASK_PARTS:
        s = runner[name]
        assert s["count"] == rounds - warmup, name
        assert 0 < s["p50_ms"] <= s["p99_ms"], name
    # The runner's overhead is its whole task minus the executor, so it is below the whole task.
    assert runner["overhead"]["p50_ms"] <= runner["per_task"]["p50_ms"]
    assert runner["pending_write"]["p50_ms"] > 0
    assert set(overhead["ratios"]) == {
        "runner_overhead_to_echo_rtt",
        "bare_device_task_to_echo_rtt",
        "runner_overhead_to_bare_device_task",
        "runner_above_floor_ms",
    }
    assert overhead["ratios"]["runner_overhead_to_echo_rtt"] > 0

    upload = report["upload"]
    assert len(upload["runner"]) == config["upload_repeats"] >= 1
    for one in upload["runner"]:
        assert one["checks"]["sha256_matched"] and one["checks"]["uploaded_through_blob"]
        assert one["checks"]["acknowledged"] and one["checks"]["job_finished"]
        # The update went through the blob path: larger than the transport's 2 MiB inline threshold.
        assert one["update_bytes"] > 2 * 1024**2
        assert 0 < one["upload_blob_s"] <= one["report_s"]
        assert one["coordinator_peak_rss_mib"] > 0 and one["coordinator_rss_before_mib"] > 0
    assert upload["raw"]["update_bytes"] == upload["runner"][0]["update_bytes"]
    assert upload["raw"]["checks"]["every_byte_received"]
    assert upload["raw"]["mb_per_s"] > 0 and upload["ratio_to_raw"] > 0
    assert all(report["checks"].values()) and "upload0.sha256_matched" in report["checks"]
