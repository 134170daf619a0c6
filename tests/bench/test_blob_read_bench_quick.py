"""The blob read benchmark's quick mode measures every read of every backend."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    # bench/ holds scripts run from the repository root (python -m bench.X), not an installed package.
    sys.path.insert(0, str(ROOT))
bench = importlib.import_module("bench.blob_read_bench")

READS = ("raw read", "read, first", "raw stream", "stream, first", "read, again", "stream, again")


def test_quick_run_measures_every_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "blob_read.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mib"] == 4 and report["repeats"] == 1 and report["sha256_s"] > 0
    assert set(report["backends"]) == {"SQLite + files", "SQLite chunk rows"}
    for name, figures in report["backends"].items():
        assert set(figures) == set(READS), name
        assert all(f["wall_s"] > 0 and f["cpu_s"] >= 0 for f in figures.values()), name
    printed = capsys.readouterr().out
    assert "sha256 in memory" in printed and printed.count("stream, again") == 2
