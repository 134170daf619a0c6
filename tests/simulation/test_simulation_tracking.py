"""A simulation's rounds logged to MLflow and TensorBoard (read back with their own readers), from the
Python API, from a job file's ``[tracking]`` section with ``fedlink simulate``, and the ``--plot`` PNG."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fedlink.cli.main import cli
from fedlink.server.tracking import TrackingConfig
from fedlink.server.workflows.fedbuff import FedBuffParams
from fedlink.simulation import run_simulation

from .conftest import Digits, softmax_job
from .test_simulate_cli import JOB

pytestmark = [
    # MLflow's SQL store uses SQLAlchemy 2.1's deprecated noload; it is MLflow's, not ours.
    pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated"),
]


def _scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_a_simulation_logs_each_round_to_mlflow_in_sqlite_and_to_tensorboard(
    tmp_path: Path, digits: Digits
) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking = TrackingConfig(
        mlflow_tracking_uri=uri, mlflow_experiment="sims", tensorboard_dir=tmp_path / "tb"
    )
    result = run_simulation(
        softmax_job(rounds=3, epochs=1), 4, data=digits.source(), seed=0, tracking=tracking
    )
    losses = [r.metrics["train_loss"] for r in result.rounds]

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("sims")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["fedlink.job_id"] == result.job_id
    assert run.data.params["num_rounds"] == "3"
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in history] == [1, 2, 3]
    np.testing.assert_allclose([m.value for m in history], losses)
    assert [m.value for m in client.get_metric_history(run.info.run_id, "fedlink/num_results")] == [4.0] * 3

    (folder,) = (tmp_path / "tb").iterdir()
    assert folder.name == f"digits-{result.job_id}"
    logged = _scalars(folder, "train_loss")
    assert [step for step, _ in logged] == [1, 2, 3]
    np.testing.assert_allclose([value for _, value in logged], losses, rtol=1e-6)  # stored as float32


def test_fedbuff_model_versions_are_the_steps(tmp_path: Path, digits: Digits) -> None:
    params = FedBuffParams(
        max_model_version=4,
        device_selection_size=4,
        num_updates_for_model=2,
        min_hole_to_fill=1,
        max_model_history=2,
        seed=1,
    )
    job = dataclasses.replace(softmax_job(rounds=1), workflow=params)
    tracking = TrackingConfig(tensorboard_dir=tmp_path / "tb")
    result = run_simulation(job, 6, data=digits.source(), seed=0, tracking=tracking)
    (folder,) = (tmp_path / "tb").iterdir()
    assert [step for step, _ in _scalars(folder, "fedlink/num_results")] == [r.round for r in result.rounds]
    assert [r.round for r in result.rounds] == [1, 2, 3, 4]


def test_simulate_takes_the_job_files_tracking_section_and_plots(
    tmp_path: Path, digits: Digits, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    data = tmp_path / "digits.npz"
    np.savez(data, x_train=digits.x_train, y_train=digits.y_train)
    np.savez(tmp_path / "model.npz", weight=np.zeros((64, 10), np.float32), bias=np.zeros(10, np.float32))
    job_file = tmp_path / "job.toml"
    # Relative to the job file, as its other paths are.
    tracking = '\n[tracking]\nmlflow_tracking_uri = "file:mlruns"\ntensorboard_dir = "tb"\n'
    job_file.write_text(JOB.replace("{data}", str(data)) + tracking)
    png = tmp_path / "curves.png"
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the section's paths are the job file's, not the working directory's
    result = CliRunner().invoke(
        cli, ["simulate", str(job_file), "-n", "3", "--no-progress", "--plot", str(png)]
    )
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:4] == b"\x89PNG"
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    experiment = client.get_experiment_by_name("fedlink")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [1, 2]
    (folder,) = (tmp_path / "tb").iterdir()
    assert [step for step, _ in _scalars(folder, "train_accuracy")] == [1, 2]

    # A flag replaces the file's setting.
    flagged = CliRunner().invoke(
        cli,
        ["simulate", str(job_file), "-n", "2", "--no-progress", "--tensorboard-dir", str(tmp_path / "tb2")],
    )
    assert flagged.exit_code == 0, flagged.output
    assert len(list((tmp_path / "tb2").iterdir())) == 1
    assert len(list((tmp_path / "tb").iterdir())) == 1


def test_a_bad_tracking_section_is_an_error_naming_the_key(tmp_path: Path, digits: Digits) -> None:
    data = tmp_path / "digits.npz"
    np.savez(data, x_train=digits.x_train, y_train=digits.y_train)
    np.savez(tmp_path / "model.npz", weight=np.zeros((64, 10), np.float32), bias=np.zeros(10, np.float32))
    job_file = tmp_path / "job.toml"
    job_file.write_text(JOB.replace("{data}", str(data)) + '\n[tracking]\nmlflow_uri = "file:mlruns"\n')
    result = CliRunner().invoke(cli, ["simulate", str(job_file), "-n", "2", "--no-progress"])
    assert result.exit_code == 2
    assert "tracking: unknown key(s) mlflow_uri; allowed: mlflow_tracking_uri" in result.output
