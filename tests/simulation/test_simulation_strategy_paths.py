"""Every built-in strategy from the Python API and from a job file through ``fedlink simulate``.

The Python API test checks each strategy's arithmetic end to end on the simulation: device i adds
``0.01 * (i + 1)`` with one example, so every round's aggregate of the five devices is known exactly
(and the optimizers' steps follow their formulas, written here once more independently).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from fedlink.cli.main import cli
from fedlink.server.workflows import registry
from fedlink.server.workflows.fedavg import FedAvgParams
from fedlink.server.workflows.robust import FedMedianParams, FedTrimmedAvgParams, KrumParams
from fedlink.server.workflows.strategies import FedAdagradParams, FedAdamParams, FedAvgMParams, FedYogiParams
from fedlink.simulation import SimulationJob, run_simulation

from .conftest import AddPartition, Digits

DEVICES = 5
STEPS = [0.01 * (i + 1) for i in range(DEVICES)]  # what each device adds, every round
MEAN = sum(STEPS) / DEVICES  # 0.03: also the median and the 20 % trimmed mean of the five


def _adaptive(rule: str, lr: float, beta_1: float, beta_2: float, tau: float, correct: bool) -> float:
    """Two rounds of a FedOpt step with delta = MEAN each round, in float64."""
    x, m, v = 0.0, 0.0, 0.0
    for t in (1, 2):
        m = beta_1 * m + (1 - beta_1) * MEAN
        if rule == "adam":
            v = beta_2 * v + (1 - beta_2) * MEAN**2
        elif rule == "yogi":
            v = v - (1 - beta_2) * MEAN**2 * math.copysign(1.0, v - MEAN**2)
        else:
            v, m = v + MEAN**2, MEAN
        rate = lr * math.sqrt(1 - beta_2 ** (t + 1)) / (1 - beta_1 ** (t + 1)) if correct else lr
        x += rate * m / (math.sqrt(v) + tau)
    return x


ROUNDS: dict[str, Any] = {"num_rounds": 2, "round_timeout_s": 30.0, "devices_per_round": DEVICES}
CASES: list[tuple[Any, float]] = [
    (FedAvgParams(**ROUNDS), 2 * MEAN),
    (FedAvgMParams(**ROUNDS, server_learning_rate=1.0, server_momentum=0.5), MEAN + (0.5 * MEAN + MEAN)),
    (FedAvgMParams(**ROUNDS, server_learning_rate=0.5), 2 * 0.5 * MEAN),
    (FedAdamParams(**ROUNDS), _adaptive("adam", 0.1, 0.9, 0.99, 1e-3, True)),
    (FedAdamParams(**ROUNDS, bias_correction=False), _adaptive("adam", 0.1, 0.9, 0.99, 1e-3, False)),
    (FedYogiParams(**ROUNDS), _adaptive("yogi", 0.01, 0.9, 0.99, 1e-3, False)),
    (FedAdagradParams(**ROUNDS), _adaptive("adagrad", 0.1, 0.0, 0.0, 1e-3, False)),
    (FedMedianParams(**ROUNDS), 2 * MEAN),
    (FedTrimmedAvgParams(**ROUNDS, beta=0.2), 2 * MEAN),
]
#: Krum (f=1): devices 1, 2 and 3 score the same in exact arithmetic (their two nearest are 0.01 away);
#: which wins is decided by the rounding of the distances. Its candidates: the middle devices' updates,
#: and Multi-Krum's pairs of them.
KRUM = {1: {2 * s for s in STEPS[1:4]}, 2: {2 * (a + b) / 2 for a in STEPS[1:4] for b in STEPS[1:4] if a < b}}


def _simulate(params: Any) -> np.ndarray[Any, Any]:
    job = SimulationJob(name="paths", workflow=params, model={"w": np.zeros(4, np.float32)})
    result = run_simulation(job, DEVICES, runner=AddPartition())
    assert [r.num_results for r in result.rounds] == [DEVICES, DEVICES]
    assert result.arrays["w"].dtype == np.float32
    return result.arrays["w"]


@pytest.mark.parametrize(
    ("params", "expected"), CASES, ids=[f"{type(p).__name__}-{i}" for i, (p, _) in enumerate(CASES)]
)
def test_each_strategy_runs_from_the_python_api_with_its_arithmetic(params: Any, expected: float) -> None:
    np.testing.assert_allclose(_simulate(params), np.full(4, expected, np.float32), rtol=1e-5)


@pytest.mark.parametrize("chosen", [1, 2])
def test_krum_runs_from_the_python_api_and_takes_the_best_scored_whole(chosen: int) -> None:
    model = _simulate(KrumParams(**ROUNDS, num_malicious=1, num_to_select=chosen))
    assert len(set(model.tolist())) == 1
    assert any(math.isclose(float(model[0]), value, rel_tol=1e-5) for value in KRUM[chosen]), model
    again = _simulate(KrumParams(**ROUNDS, num_malicious=1, num_to_select=chosen))
    assert model.tobytes() == again.tobytes()  # the same updates, the same bits


def test_every_built_in_strategy_has_a_python_api_case() -> None:
    # FedBuff has no rounds: tests/simulation/test_simulation_fedbuff.py runs it from the Python API.
    assert {registry.spec_of(p).name for p, _ in CASES} | {"krum", "fedbuff"} == set(registry.BUILTIN)


JOB = """
name = "paths"
model = "model.npz"

[{section}]
num_rounds = 2
devices_per_round = 6
round_timeout = "30s"
{extra}

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
SECTIONS = {
    "fedavg": "",
    "fedavgm": "server_momentum = 0.9",
    "fedadam": "server_learning_rate = 0.05\nbeta_1 = 0.8",
    "fedyogi": "server_learning_rate = 0.05",
    "fedadagrad": "tau = 0.01",
    "fedmedian": "",
    "fedtrimmedavg": "beta = 0.2",
    "krum": "num_malicious = 1\nnum_to_select = 3",
}


def test_every_built_in_strategy_has_a_job_file_case() -> None:
    # FedBuff has no rounds: tests/simulation/test_simulation_fedbuff.py runs its job file section.
    assert set(SECTIONS) | {"fedbuff"} == set(registry.BUILTIN)


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_each_strategy_runs_from_a_job_file_with_fedlink_simulate(
    section: str, tmp_path: Path, digits: Digits
) -> None:
    data = tmp_path / "digits.npz"
    np.savez(data, x_train=digits.x_train, y_train=digits.y_train)
    np.savez(tmp_path / "model.npz", weight=np.zeros((64, 10), np.float32), bias=np.zeros(10, np.float32))
    path = tmp_path / "job.toml"
    path.write_text(JOB.format(section=section, extra=SECTIONS[section], data=data))
    out = tmp_path / "final.npz"
    result = CliRunner().invoke(
        cli, ["simulate", str(path), "--devices", "6", "--no-progress", "--save-model", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "2 rounds on 6 virtual devices" in result.output
    with np.load(out) as final:
        accuracy = digits.accuracy({"weight": final["weight"], "bias": final["bias"]})
    assert accuracy > 0.3, accuracy  # it learnt something in two rounds (ten classes: chance is 0.1)


def test_a_job_file_strategy_error_names_the_file_and_the_key(tmp_path: Path, digits: Digits) -> None:
    path = tmp_path / "job.toml"
    np.savez(tmp_path / "model.npz", weight=np.zeros((64, 10), np.float32), bias=np.zeros(10, np.float32))
    path.write_text(JOB.format(section="fedadam", extra="beta_1 = 1.5", data=tmp_path / "x.npz"))
    result = CliRunner().invoke(cli, ["simulate", str(path), "--devices", "2"])
    assert result.exit_code != 0
    assert f"{path}: fedadam.beta_1 must be in [0, 1)" in result.output
    path.write_text(JOB.format(section="fedadam", extra="momentum = 0.9", data=tmp_path / "x.npz"))
    result = CliRunner().invoke(cli, ["simulate", str(path), "--devices", "2"])
    assert result.exit_code != 0
    assert "unknown key(s) in fedadam: momentum" in result.output
    two = JOB.format(section="fedadam", extra="", data=tmp_path / "x.npz") + "\n[fedmedian]\nnum_rounds = 1\n"
    path.write_text(two)
    result = CliRunner().invoke(cli, ["simulate", str(path), "--devices", "2"])
    assert result.exit_code != 0
    assert "exactly one workflow section" in result.output and "fedadam, fedmedian" in result.output
