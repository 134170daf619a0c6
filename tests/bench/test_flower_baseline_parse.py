"""The Flower baseline's parts that need no Flower: result parsing, version choice, expected model, memory."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import numpy.typing as npt
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


baseline = _load("flower_baseline_under_test", ROOT / "bench" / "flower_baseline.py")
worker = _load("flower_run_config_under_test", ROOT / "bench" / "flower_app" / "run_config.py")


def _line(**fields: object) -> str:
    record: dict[str, object] = {
        "devices": 10,
        "floats": 100,
        "rounds": 3,
        "wall_s": 7.5,
        "ok": True,
        "flower_version": "1.42.0",
        "error": None,
    }
    record.update(fields)
    marker: str = baseline.RESULT_MARKER
    return marker + json.dumps(record)


def test_the_result_line_is_found_among_flower_logs_and_the_last_one_wins() -> None:
    stdout = "\n".join(["INFO : [ROUND 1/3]", _line(wall_s=1.0), "INFO : done", _line(wall_s=2.5), ""])
    record = baseline.parse_result(stdout)
    assert record["wall_s"] == 2.5 and record["devices"] == 10 and record["flower_version"] == "1.42.0"


def test_the_worker_prints_what_the_parser_reads() -> None:
    # The two sides share the marker; a rename on one side alone would lose every result.
    assert worker.RESULT_MARKER == baseline.RESULT_MARKER


@pytest.mark.parametrize(
    ("stdout", "complaint"),
    [
        ("INFO : no result here\n", "no result line"),
        (baseline.RESULT_MARKER + "{not json", "unreadable"),
        (baseline.RESULT_MARKER + "[1, 2]", "not an object"),
        (_line(devices=None), "'devices'"),
        (_line(ok="yes"), "'ok'"),
        (_line(wall_s=True), "'wall_s'"),
        (_line(flower_version=142), "'flower_version'"),
        (_line(wall_s=0.0), "wall time"),
    ],
)
def test_bad_output_is_an_error_naming_the_problem(stdout: str, complaint: str) -> None:
    with pytest.raises(baseline.BaselineError, match=complaint):
        baseline.parse_result(stdout)


def test_a_failed_run_parses_with_its_error() -> None:
    record = baseline.parse_result(_line(ok=False, wall_s=3.0, error="final model off by 0.1"))
    assert record["ok"] is False and record["error"] == "final model off by 0.1"


@pytest.mark.parametrize(
    ("available", "chosen"),
    [
        (["1.43.0", "1.42.0", "1.41.0"], "1.42.0"),
        (["1.42.0", "1.42.1", "1.43.0"], "1.42.1"),
        (["1.44.0", "1.43.0", "1.41.2", "1.41.0"], "1.41.2"),  # equally near: the older series
        (["1.45.0", "1.43.1", "1.40.0"], "1.43.1"),
        ([" 1.42.0", "1.42.0rc1", "junk"], "1.42.0"),
    ],
)
def test_the_nearest_flower_release_is_chosen(available: list[str], chosen: str) -> None:
    assert baseline.nearest_version(available) == chosen


def test_no_release_at_all_is_an_error() -> None:
    with pytest.raises(baseline.BaselineError, match="no Flower release"):
        baseline.nearest_version(["", "latest"])


@pytest.mark.parametrize("text", ["10,x", "0", "10,-1", ""])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"integer|positive"):
        baseline.parse_sizes(text)


def test_sizes_parse() -> None:
    assert baseline.parse_sizes("10, 100,1_000") == [10, 100, 1000]


def _fedavg_by_definition(
    devices: int, floats: int, rounds: int, weighted: bool = True
) -> npt.NDArray[np.float32]:
    """FedAvg as the workload defines it, in float32 like Flower's aggregate (sum of value x weight)."""
    model: npt.NDArray[np.float32] = worker.initial_model(floats)
    weights = np.arange(1, devices + 1, dtype=np.float64)
    factors = weights / weights.sum() if weighted else np.full(devices, 1.0 / devices)
    for _ in range(rounds):
        total = np.zeros(floats, dtype=np.float32)
        for i in range(devices):
            # A Python float weight, as in Flower: the product stays float32.
            total += (model + np.float32(worker.STEP * (i + 1))) * float(factors[i])
        model = total
    return model


@pytest.mark.parametrize("devices", [1, 7, 1000])
def test_the_expected_model_is_fedavg_of_the_trivial_step_within_the_tolerance(devices: int) -> None:
    floats, rounds = 300, 3
    expected = worker.expected_model(worker.initial_model(floats), devices, rounds)
    error = np.max(np.abs(_fedavg_by_definition(devices, floats, rounds) - expected))
    assert error <= worker.tolerance(devices, rounds), error


@pytest.mark.parametrize("devices", [10, 1000])
def test_the_tolerance_still_catches_an_unweighted_average(devices: int) -> None:
    floats, rounds = 300, 3
    expected = worker.expected_model(worker.initial_model(floats), devices, rounds)
    error = np.max(np.abs(_fedavg_by_definition(devices, floats, rounds, weighted=False) - expected))
    assert error > 10 * worker.tolerance(devices, rounds), error


_HOLDER = """
import pathlib, subprocess, sys, time
block = bytearray(int(sys.argv[1]) * 2**20)
block[::4096] = b"x" * len(block[::4096])  # touch every page so it is resident
if len(sys.argv) > 3:
    # Through an intermediate that exits at once: the grandchild is re-parented, found only by its tag.
    spawn = "import subprocess, sys; subprocess.Popen([sys.executable, *sys.argv[1:]])"
    subprocess.run([sys.executable, "-c", spawn, __file__, *sys.argv[3:]], check=True)
pathlib.Path(sys.argv[2]).touch()
time.sleep(60)
"""


@pytest.fixture
def tagged_tree(tmp_path: Path) -> Iterator[tuple[int, str, int]]:
    """(root pid, tag, grandchild pid): the root holds 64 MiB, its re-parented grandchild 48 MiB."""
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    tag = "test-" + os.urandom(6).hex()
    env = os.environ | {baseline.TAG_VARIABLE: tag}
    ready = [tmp_path / "root.ready", tmp_path / "grandchild.ready"]
    command = [sys.executable, str(script), "64", str(ready[0]), "48", str(ready[1])]
    root = subprocess.Popen(command, env=env)
    tree = baseline.ProcessTree(root.pid, tag)
    try:
        deadline = time.monotonic() + 15
        while not all(path.exists() for path in ready):
            assert time.monotonic() < deadline and root.poll() is None, "the holder processes did not start"
            time.sleep(0.05)
        grandchild = next(pid for pid in tree.members() if pid != root.pid)
        yield root.pid, tag, grandchild
    finally:
        for pid in tree.members():
            os.kill(pid, signal.SIGKILL)
        root.wait()


def test_the_memory_sample_counts_the_root_and_a_reparented_tagged_process(
    tagged_tree: tuple[int, str, int],
) -> None:
    root, tag, grandchild = tagged_tree
    parent = int(Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert parent != root, "the grandchild should have been re-parented"
    memory = baseline.TreeMemory()
    members = baseline.sample_tree(baseline.ProcessTree(root, tag), memory)
    assert members.keys() == {root, grandchild}
    # 64 + 48 MiB held, plus two interpreters; the other processes on the machine are not counted.
    assert 112 * 2**20 < memory.peak_rss_bytes < 400 * 2**20, memory
    assert 100 * 2**20 < memory.peak_pss_bytes <= memory.peak_rss_bytes, memory
    assert memory.max_processes == 2 and memory.samples == 1


def test_an_untagged_process_outside_the_tree_is_not_counted(tagged_tree: tuple[int, str, int]) -> None:
    root, _, grandchild = tagged_tree
    members = baseline.ProcessTree(root, "another-run").members()
    assert grandchild not in members and members.keys() == {root}, members
