"""``fedlink simulate`` of a job file made for real runners: the job's own trainer by import path (from
beside the job file), the devices' data from ``--data`` or the ``[simulation]`` section, split per
device as ``fedlink runner --partition-id I --num-partitions N`` splits it, from any directory."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fedlink.cli.main import cli
from fedlink.runner.config import ResolverRegistry
from fedlink.runner.data import DeviceData
from fedlink.runner.executors import SoftmaxRegressionTrainer
from fedlink.simulation import run_simulation

from .conftest import Digits

#: The job's trainer, in a module beside the job file (as examples/pytorch/digits_cnn.py is).
TRAINER_MODULE = '''
from fedlink.runner.executors import SoftmaxRegressionTrainer


class Trainer(SoftmaxRegressionTrainer):
    """The built-in softmax regression, under the job's own name."""
'''

JOB = """
name = "one-file"
model = "model.npz"

[fedavg]
num_rounds = 2
devices_per_round = 4
min_results = 4
seed = 3
round_timeout = "600s"

[job_data]
components = [
    { type = "beside_job_trainer:Trainer", name = "trainer", args = { learning_rate = 0.3, seed = 5 } },
]
executors = { "*" = "@trainer" }

[simulation]
devices = 4
data = "data/digits.npz"
partition = "dirichlet"
partition_alpha = 0.3
partition_seed = 7
"""


@pytest.fixture
def job_file(tmp_path: Path, digits: Digits) -> Iterator[Path]:
    folder = tmp_path / "job"
    (folder / "data").mkdir(parents=True)
    np.savez(folder / "data" / "digits.npz", x_train=digits.x_train, y_train=digits.y_train)
    np.savez(folder / "model.npz", weight=np.zeros((64, 10), np.float32), bias=np.zeros(10, np.float32))
    (folder / "beside_job_trainer.py").write_text(TRAINER_MODULE)
    path = folder / "job.toml"
    path.write_text(JOB)
    yield path
    sys.modules.pop("beside_job_trainer", None)


def simulate(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["simulate", *args, "--no-progress"])
    return result.exit_code, result.output


def test_the_job_s_own_trainer_and_the_sections_data_give_what_runners_would_train(
    job_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # not the job's folder: its paths are relative to the job file
    code, output = simulate(str(job_file), "--save-model", "cli.npz")
    assert code == 0, output
    assert "2 rounds on 4 virtual devices" in output
    assert str(job_file.parent) not in sys.path  # the job's folder was on the module path for the run only

    # What four runners with --data digits.npz --partition-id I --num-partitions 4 --partition
    # dirichlet --partition-alpha 0.3 --partition-seed 7 would train on, given as Python objects.
    data = DeviceData(path=job_file.parent / "data" / "digits.npz", partition="dirichlet", alpha=0.3, seed=7)
    registry = ResolverRegistry({"beside_job_trainer:Trainer": SoftmaxRegressionTrainer})
    expected = run_simulation(job_file, 4, runner=registry, data=data.partitioned())
    with np.load(tmp_path / "cli.npz") as got:
        assert sorted(got.files) == sorted(expected.arrays)
        for name, array in expected.arrays.items():
            np.testing.assert_array_equal(got[name], array, err_msg=name)
    assert not np.allclose(expected.arrays["weight"], 0.0)


def test_data_flags_replace_the_section_and_a_missing_file_is_named(job_file: Path, tmp_path: Path) -> None:
    code, output = simulate(str(job_file), "--data", str(tmp_path / "none.npz"))
    assert code == 2 and f"--data: data file {tmp_path / 'none.npz'} does not exist" in output, output
    (job_file.parent / "data" / "digits.npz").rename(tmp_path / "moved.npz")
    code, output = simulate(str(job_file))
    expected = job_file.parent / "data" / "digits.npz"
    assert code == 2 and f"simulation.data: data file {expected} does not exist" in output, output
    code, output = simulate(
        str(job_file), "--data", str(tmp_path / "moved.npz"), "--partition", "iid", "-n", "5"
    )
    assert code == 0, output
    assert "2 rounds on 5 virtual devices" in output


def test_without_devices_in_flags_or_section_it_says_how_to_give_them(job_file: Path) -> None:
    job_file.write_text(JOB.replace("devices = 4\n", ""))
    code, output = simulate(str(job_file))
    assert code == 2 and "give --devices N, or devices = N in" in output, output


def test_a_broken_job_data_is_refused_before_anything_runs(job_file: Path) -> None:
    job_file.write_text(
        JOB.replace('"*" = "@trainer"', '"train" = "@trainer"').replace(
            "seed = 3", "seed = 3\nevaluate = true"
        )
    )
    code, output = simulate(str(job_file))
    assert code == 2 and "no executor for task 'evaluate', which the fedavg workflow sends" in output, output
    job_file.write_text(JOB.replace("beside_job_trainer:Trainer", "beside_job_trainer:Trainr"))
    code, output = simulate(str(job_file))
    assert code == 2 and "has no public class or factory 'Trainr'" in output, output
