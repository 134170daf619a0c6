"""The PyTorch trainer benchmark's quick mode runs end to end, measures every side and phase, and its
checks hold (the trainer's result is the bare loop's, bit for bit); its targets are judged from the
figures."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="the PyTorch benchmark needs torch: pip install 'fedlink[torch]'")

from bench.orphans import tied

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    # bench/ holds scripts run from the repository root (python -m bench.X), not an installed package.
    sys.path.insert(0, str(ROOT))
bench = importlib.import_module("bench.torch_bench")

PHASES = ("task", "decode", "execute", "train", "conversion", "encode", "encode_once")


@pytest.mark.slow
def test_quick_run_measures_every_side_and_passes_its_checks(tmp_path: Path) -> None:
    out = tmp_path / "torch.json"
    done = subprocess.run(
        tied([sys.executable, "-m", "bench.torch_bench", "--quick", "--json", str(out)]),
        capture_output=True,
        text=True,
        timeout=540,  # below the slow tests' 600 s ceiling (tests/conftest.py)
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checks: all passed" in done.stdout
    assert any(line.startswith("targets: ") for line in done.stdout.splitlines())
    report = json.loads(out.read_text())
    assert report["ok"] is True
    config = report["config"]
    assert config["quick"] is True and config["samples"] == 256 and config["repeats"] == 2
    assert set(report["sizes"]) == {"10k", "100k"}
    for size, row in report["sizes"].items():
        assert row["parameters"] == bench.parameter_count(bench.QUICK_SIZES[size])
        assert row["model_bytes"] == 4 * row["parameters"]
        assert row["judged"] is False  # too small to judge the targets by
        runs = row["runs"]
        assert {side: len(runs[side]) for side in bench.SIDES} == dict.fromkeys(bench.SIDES, 2)
        assert row["sides"]["bare"]["task_cpu_s"] > 0
        for side in bench.FEDLINK_SIDES:
            figures = row["sides"][side]
            for phase in PHASES:
                assert figures[f"{phase}_s"] > 0 and figures[f"{phase}_cpu_s"] >= 0, (size, side, phase)
            # The task is its parts; the training loop is inside execute_task.
            assert figures["task_s"] == pytest.approx(
                figures["decode_s"] + figures["execute_s"] + figures["encode_s"], rel=0.5
            )
            assert figures["train_s"] <= figures["execute_s"]
            assert figures["ratio_to_bare"] > 0 and figures["trainer_ratio_to_bare"] > 0
            # One module per trainer, however many tasks it ran.
            assert row["models_built"][side] == 1
        memory = row["memory"]
        for side in bench.SIDES:
            assert memory["peak_models"][side] > 0, (size, side)
        for side in bench.FEDLINK_SIDES:
            assert memory["encode_peak_models"][side] >= 0
            assert memory["extra_models"][side] == pytest.approx(
                memory["peak_models"][side] - memory["peak_models"]["bare"]
            )
    assert set(report["targets"].values()) == {None}


@pytest.fixture
def torch_settings() -> Iterator[None]:
    """The bench sets PyTorch's process-wide thread count and determinism: put them back."""
    torch = bench.torch
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


@pytest.mark.usefixtures("torch_settings")
def test_the_bare_loop_trains_as_the_trainer_does_and_a_changed_loop_fails_the_check() -> None:
    w = bench.Workload(size="tiny", hidden=(8,), samples=64, epochs=2, threads=1)
    bench.setup_torch(w)
    x, y = bench.make_data(w)
    initial = bench.initial_arrays(w)
    model = bench.build_model(w.hidden)
    bench.load(model, initial)
    bench.bare_loop(model, bench.torch.from_numpy(x), bench.torch.from_numpy(y), w)
    expected = {name: t.detach().numpy() - initial[name] for name, t in model.state_dict().items()}
    for side in bench.FEDLINK_SIDES:
        times, result = bench.fedlink_task(bench.fedlink_side(w, side, x, y), [bench.task_wire(w, initial)])
        bench._check_result(side, result, expected, w.samples)  # two epochs: the same batch order
        assert times["train_s"] > 0
    other = bench.replace(w, learning_rate=0.02)
    _, result = bench.fedlink_task(bench.fedlink_side(other, "fedlink", x, y), [bench.task_wire(w, initial)])
    with pytest.raises(bench.CheckFailed, match="differs from the bare loop"):
        bench._check_result("fedlink", result, expected, w.samples)


def test_targets_are_judged_from_the_figures() -> None:
    def row(ratio: float, trainer_ratio: float, extra: float, judged: bool = True) -> dict[str, Any]:
        return {
            "judged": judged,
            "sides": {"fedlink": {"ratio_to_bare": ratio, "trainer_ratio_to_bare": trainer_ratio}},
            "memory": {"extra_models": {"fedlink": extra}},
        }

    report = {
        "sizes": {"10m": row(1.12, 1.06, 1.02), "big": row(1.08, 1.05, 1.2), "100k": row(2, 2, 9, False)}
    }
    assert bench.targets(report) == {
        "10m_task_within_10pct_of_bare": False,
        "10m_trainer_without_encoding_within_10pct": True,
        "10m_at_most_one_extra_model_copy": True,
        "big_task_within_10pct_of_bare": True,
        "big_trainer_without_encoding_within_10pct": True,
        "big_at_most_one_extra_model_copy": False,
        "100k_task_within_10pct_of_bare": None,
        "100k_trainer_without_encoding_within_10pct": None,
        "100k_at_most_one_extra_model_copy": None,
    }
    assert bench.targets({"sizes": {}}) == {}
