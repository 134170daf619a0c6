"""``fedlink simulate`` end to end on a tiny job file (data and model as .npz files)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fedlink.cli.main import cli

from .conftest import Digits

JOB = """
name = "tiny"
model = "model.npz"

[fedavg]
num_rounds = 2
round_timeout = "30s"

[[job_data.components]]
type = "NpzDataSource"
name = "all"
args = { path = "{data}" }

[[job_data.components]]
type = "PartitionedDataSource"
name = "mine"
args = { source = "@all" }

[[job_data.components]]
type = "SoftmaxRegressionTrainer"
name = "trainer"
args = { epochs = 2, learning_rate = 0.5, batch_size = 8, data_source = "@mine" }
"""


@pytest.fixture
def job_file(tmp_path: Path, digits: Digits) -> Path:
    data = tmp_path / "digits.npz"
    np.savez(data, x_train=digits.x_train, y_train=digits.y_train)
    np.savez(tmp_path / "model.npz", weight=np.zeros((64, 10), np.float32), bias=np.zeros(10, np.float32))
    path = tmp_path / "job.toml"
    path.write_text(JOB.replace("{data}", str(data)))
    return path


def test_simulate_runs_a_job_file_and_writes_metrics_model_and_summary(
    job_file: Path, digits: Digits
) -> None:
    out = job_file.parent
    result = CliRunner().invoke(
        cli,
        [
            "simulate",
            str(job_file),
            "--devices",
            "8",
            "--seed",
            "1",
            "--jsonl",
            str(out / "m.jsonl"),
            "--save-model",
            str(out / "final.npz"),
            "--backend-config",
            '{"num_cpus": 1}',
        ],
    )
    assert result.exit_code == 0, result.output
    assert "2 rounds on 8 virtual devices" in result.output
    assert "round 2: 8/8 results" in result.output and "train_accuracy=" in result.output
    rounds = [json.loads(line) for line in (out / "m.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2] and "train_loss" in rounds[1]["metrics"]
    with np.load(out / "final.npz") as final:
        assert digits.accuracy({"weight": final["weight"], "bias": final["bias"]}) > 0.5


def test_simulate_reports_bad_backend_config_and_missing_matplotlib(job_file: Path) -> None:
    bad = CliRunner().invoke(cli, ["simulate", str(job_file), "-n", "2", "--backend-config", '{"gpus": 1}'])
    assert bad.exit_code != 0 and "unknown backend_config key(s) for the local backend: gpus" in bad.output
    plotted = CliRunner().invoke(
        cli, ["simulate", str(job_file), "-n", "2", "--no-progress", "--plot", str(job_file.parent / "p.png")]
    )
    if importlib.util.find_spec("matplotlib") is None:
        assert plotted.exit_code != 0 and "pip install 'fedlink[plot]'" in plotted.output
    else:
        assert plotted.exit_code == 0, plotted.output
        assert (job_file.parent / "p.png").read_bytes()[:4] == b"\x89PNG"
