"""FedBuff on the simulation: from the Python API and a job file, learning the digits, and synchronous
FedAvg as its special case (selection = devices per round, K = selection, history 1, global_lr 1)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
from click.testing import CliRunner

from fedlink.cli.main import cli
from fedlink.server.workflows.fedavg import FedAvgParams
from fedlink.server.workflows.fedbuff import FedBuffParams
from fedlink.simulation import SimulationJob, run_simulation

from .conftest import AddPartition, Digits, softmax_job

DEVICES = 8


def _as_fedavg(rounds: int, devices: int) -> FedBuffParams:
    """FedBuff set up as FedAvg's rounds of every device: each version is one round's mean."""
    return FedBuffParams(
        max_model_version=rounds,
        device_selection_size=devices,
        num_updates_for_model=devices,
        min_hole_to_fill=devices,
        max_model_history=1,
        global_lr=1.0,
        device_sampling_strategy="random",
        seed=5,
    )


def test_fedbuff_with_fedavgs_settings_makes_fedavgs_model_within_float32_rounding(digits: Digits) -> None:
    job = softmax_job(rounds=3, epochs=1)
    fedavg = run_simulation(
        dataclasses.replace(job, workflow=FedAvgParams(num_rounds=3, devices_per_round=DEVICES, seed=5)),
        DEVICES,
        data=digits.source(alpha=0.5),
        seed=0,
    )
    fedbuff = run_simulation(
        dataclasses.replace(job, workflow=_as_fedavg(3, DEVICES)),
        DEVICES,
        data=digits.source(alpha=0.5),
        seed=0,
    )
    assert [r.num_results for r in fedbuff.rounds] == [DEVICES] * 3
    for name, value in fedavg.arrays.items():
        assert fedbuff.arrays[name].dtype == value.dtype
        np.testing.assert_array_max_ulp(fedbuff.arrays[name], value, maxulp=1)
    assert not np.array_equal(fedbuff.arrays["weight"], np.zeros((64, 10), np.float32))


def test_fedbuff_learns_the_digits_asynchronously_from_the_python_api(digits: Digits) -> None:
    # Which devices report first is the machine's timing, so the model varies from run to run: after 12
    # versions, 0.77-0.96 held-out accuracy (30 runs; under 0.85 in 4-7 of them), after 30, 0.90-0.96.
    params = FedBuffParams(
        max_model_version=30,
        device_selection_size=6,
        num_updates_for_model=3,
        max_model_history=4,
        staleness_weight=True,
        seed=1,
    )
    job = dataclasses.replace(softmax_job(rounds=1, epochs=1), workflow=params)
    result = run_simulation(job, DEVICES, data=digits.source(alpha=1.0), seed=0)
    assert [r.round for r in result.rounds] == list(range(1, 31))
    assert all(r.num_results >= 3 for r in result.rounds)
    assert digits.accuracy(result.arrays) > 0.85


def test_each_update_counts_once_and_versions_mix_trained_on_versions() -> None:
    # AddPartition: device i adds 0.01 (i + 1) with one example; selection 4 of 6, K = 2
    params = FedBuffParams(
        max_model_version=6, device_selection_size=4, num_updates_for_model=2, max_model_history=0, seed=2
    )
    job = SimulationJob(name="buffered", workflow=params, model={"w": np.zeros(3, np.float32)})
    result = run_simulation(job, 6, runner=AddPartition())
    assert len(result.rounds) == 6
    assert sum(r.num_results for r in result.rounds) >= 12
    # every version is a mean of updates in [0.01, 0.06]: the model moved by 6 such means
    assert 6 * 0.01 - 1e-6 <= float(result.arrays["w"][0]) <= 6 * 0.06 + 1e-6


JOB = """
name = "buffered"
model = "model.npz"

[fedbuff]
max_model_version = 4
device_selection_size = 4
num_updates_for_model = 3
max_model_history = 3
staleness_weight = true
task_timeout = "2m"
device_wait_timeout = "1m"

[[job_data.components]]
type = "NpzDataSource"
name = "all"
args = {{ path = "{data}" }}

[[job_data.components]]
type = "PartitionedDataSource"
name = "mine"
args = {{ source = "@all" }}

[[job_data.components]]
type = "SoftmaxRegressionTrainer"
name = "trainer"
args = {{ epochs = 1, learning_rate = 0.5, batch_size = 8, data_source = "@mine" }}
"""


def test_fedbuff_runs_from_a_job_file_with_fedlink_simulate(tmp_path: Path, digits: Digits) -> None:
    data = tmp_path / "digits.npz"
    np.savez(data, x_train=digits.x_train, y_train=digits.y_train)
    np.savez(tmp_path / "model.npz", weight=np.zeros((64, 10), np.float32), bias=np.zeros(10, np.float32))
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(data=data))
    out, metrics = tmp_path / "final.npz", tmp_path / "metrics.jsonl"
    result = CliRunner().invoke(
        cli,
        [
            "simulate",
            str(path),
            "--devices",
            "6",
            "--no-progress",
            "--save-model",
            str(out),
            "--jsonl",
            str(metrics),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "4 rounds on 6 virtual devices" in result.output
    lines: list[dict[str, Any]] = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2, 3, 4]
    with np.load(out) as final:
        accuracy = digits.accuracy({"weight": final["weight"], "bias": final["bias"]})
    assert accuracy > 0.3, accuracy
