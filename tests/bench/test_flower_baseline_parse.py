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
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import numpy.typing as npt
import pytest

from bench.orphans import tied

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
import os, pathlib, subprocess, sys, time
megabytes, ready, children = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
block = bytearray(megabytes * 2**20)
block[::4096] = b"x" * len(block[::4096])  # touch every page so it is resident
for child in children:
    size, child_ready, how = child.split(":")
    # Through an intermediate that exits at once: the grandchild is re-parented, so only its mark
    # finds it; "env" keeps the tag in its environment, "cwd" clears the environment and keeps the cwd.
    env = dict(os.environ) if how == "env" else {"PATH": os.environ["PATH"]}
    cwd = "/" if how == "env" else None
    spawn = "import subprocess, sys; subprocess.Popen([sys.executable, *sys.argv[1:]])"
    subprocess.run([sys.executable, "-c", spawn, __file__, size, child_ready], env=env, cwd=cwd, check=True)
pathlib.Path(ready).touch()
time.sleep(60)
"""


@dataclass(frozen=True)
class Holders:
    """A root holding 64 MiB; its re-parented grandchildren, one tagged (48 MiB), one in the workdir (32)."""

    root: int
    tag: str
    workdir: Path
    tagged: int
    in_workdir: int


@pytest.fixture
def holders(tmp_path: Path) -> Iterator[Holders]:
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    workdir = (tmp_path / "run").resolve()
    workdir.mkdir()
    tag = "test-" + os.urandom(6).hex()
    ready = [tmp_path / name for name in ("root", "tagged", "cwd")]
    command = [sys.executable, str(script), "64", str(ready[0])]
    command += [f"48:{ready[1]}:env", f"32:{ready[2]}:cwd"]
    root = subprocess.Popen(tied(command), env=os.environ | {baseline.TAG_VARIABLE: tag}, cwd=workdir)
    tree = baseline.ProcessTree(root.pid, tag, workdir)
    try:
        deadline = time.monotonic() + 120  # three interpreters starting: seconds, more on a loaded machine
        while not all(path.exists() for path in ready):
            assert time.monotonic() < deadline and root.poll() is None, "the holder processes did not start"
            time.sleep(0.05)
        by_cwd = {pid: os.readlink(f"/proc/{pid}/cwd") for pid in tree.members() if pid != root.pid}
        tagged = next(pid for pid, cwd in by_cwd.items() if cwd == "/")
        in_workdir = next(pid for pid, cwd in by_cwd.items() if cwd == str(workdir))
        yield Holders(root.pid, tag, workdir, tagged, in_workdir)
    finally:
        for pid in tree.members():
            os.kill(pid, signal.SIGKILL)
        root.wait()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_the_memory_sample_counts_the_root_and_its_reparented_marked_processes(holders: Holders) -> None:
    assert holders.root not in (_parent(holders.tagged), _parent(holders.in_workdir)), "not re-parented"
    memory = baseline.TreeMemory()
    members = baseline.sample_tree(baseline.ProcessTree(holders.root, holders.tag, holders.workdir), memory)
    assert members.keys() == {holders.root, holders.tagged, holders.in_workdir}
    # 64 + 48 + 32 MiB held, plus three interpreters; the other processes on the machine are not counted.
    assert 144 * 2**20 < memory.peak_rss_bytes < 500 * 2**20, memory
    assert 130 * 2**20 < memory.peak_pss_bytes <= memory.peak_rss_bytes, memory
    assert memory.max_processes == 3 and memory.samples == 1


def test_each_mark_alone_finds_its_process(holders: Holders) -> None:
    by_tag = baseline.ProcessTree(holders.root, holders.tag).members()
    assert by_tag.keys() == {holders.root, holders.tagged}, by_tag
    by_workdir = baseline.ProcessTree(holders.root, "another-run", holders.workdir).members()
    assert by_workdir.keys() == {holders.root, holders.in_workdir}, by_workdir
    unmarked = baseline.ProcessTree(holders.root, "another-run").members()
    assert unmarked.keys() == {holders.root}, unmarked
