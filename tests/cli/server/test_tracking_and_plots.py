"""Experiment tracking of served jobs (MLflow, TensorBoard, read back with their own readers),
``fedlink job plot``, ``fedlink health`` and the metrics endpoint's one path, against a real coordinator."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from bench.orphans import tied
from fedlink.server.cli.health import decode_status, encode_request
from fedlink.server.cli.plot import MetricHistory, draw_history
from fedlink.server.settings import CoordinatorSettings

from .conftest import Cli, CoordinatorThread, StubDevice, cli_for, plaintext_settings
from .test_cli_jobs import submit, write_job
from .test_operator_cli_without_server_extra import WITHOUT_SERVER_EXTRA

pytestmark = [
    # MLflow's SQL store uses SQLAlchemy 2.1's deprecated noload; it is MLflow's, not ours.
    pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated"),
]


def _train(coordinator: CoordinatorThread, deltas: tuple[float, ...] = (1.0, 3.0)) -> list[int]:
    async def devices() -> list[int]:
        async with grpc.aio.insecure_channel(coordinator.address) as channel:
            enrolled = [await StubDevice(channel).enroll() for _ in deltas]
            trained = (d.train(x, loss=x) for d, x in zip(enrolled, deltas, strict=True))
            return list(await asyncio.gather(*trained))

    return coordinator.submit(devices()).result(timeout=60)


def _run_job(coordinator: CoordinatorThread, cli: Cli, folder: Path, rounds: int = 3) -> str:
    job_id = submit(cli, write_job(folder, rounds=rounds))
    assert _train(coordinator) == [rounds, rounds]
    watched = cli("job", "watch", job_id, "--no-results")
    assert watched.exit_code == 0, watched.output
    return job_id


def test_a_served_job_is_logged_to_mlflow_and_tensorboard_per_round(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings = dataclasses.replace(
        plaintext_settings(tmp_path / "data"),
        mlflow_tracking_uri=f"file:{tmp_path / 'mlruns'}",
        mlflow_experiment="served",
        tensorboard_dir=tmp_path / "tb",
    )
    with CoordinatorThread(settings) as coordinator:
        job_id = _run_job(coordinator, cli_for(coordinator), tmp_path)
    # Stopped: whatever was queued has been delivered and the sinks closed.

    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    experiment = client.get_experiment_by_name("served")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags["fedlink.job_id"] == job_id
    assert run.info.run_name == f"digits ({job_id})"
    assert run.info.status == "FINISHED"
    assert run.data.params["workflow"] == "fedavg" and run.data.params["num_rounds"] == "3"
    results = client.get_metric_history(run.info.run_id, "fedlink/num_results")
    assert [(m.step, m.value) for m in results] == [(1, 2.0), (2, 2.0), (3, 2.0)]
    sampled = client.get_metric_history(run.info.run_id, "fedlink/num_devices")
    assert [m.value for m in sampled] == [2.0, 2.0, 2.0]

    (folder,) = (tmp_path / "tb").iterdir()
    assert folder.name == f"digits-{job_id}"
    events = EventAccumulator(str(folder))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert "fedlink/num_results" in scalars and "fedlink/duration_s" in scalars
    assert [(e.step, e.value) for e in events.Scalars("fedlink/num_results")] == [
        (1, 2.0),
        (2, 2.0),
        (3, 2.0),
    ]
    assert all(e.value >= 0 for e in events.Scalars("fedlink/duration_s"))


def test_an_aborted_job_ends_its_mlflow_run_killed_in_a_sql_store(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    settings = dataclasses.replace(plaintext_settings(tmp_path / "data"), mlflow_tracking_uri=uri)
    with CoordinatorThread(settings) as coordinator:
        cli = cli_for(coordinator)
        job_id = submit(cli, write_job(tmp_path, rounds=50))

        async def devices() -> list[int]:
            async with grpc.aio.insecure_channel(coordinator.address) as channel:
                enrolled = [await StubDevice(channel).enroll() for _ in range(2)]
                return list(await asyncio.gather(*(d.train(1.0) for d in enrolled)))

        training = coordinator.submit(devices())
        deadline = time.monotonic() + 60
        while json.loads(cli("job", "show", job_id, "--format", "json").stdout)["completed_rounds"] < 2:
            assert time.monotonic() < deadline, "no two rounds closed within 60s"
            time.sleep(0.1)
        assert cli("job", "abort", job_id).exit_code == 0
        # The stub devices stop at their first report after the abort (answered DONE, not OK).
        training.exception(timeout=60)
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("fedlink")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags["fedlink.job_id"] == job_id
    assert run.info.status == "KILLED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "fedlink/num_results")]
    assert steps[:2] == [1, 2] and steps == sorted(steps)


def test_a_failing_sink_is_logged_once_and_the_job_and_the_other_sink_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow.tracking import MlflowClient

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the TensorBoard folder should go")
    settings = dataclasses.replace(
        plaintext_settings(tmp_path / "data"),
        mlflow_tracking_uri=f"file:{tmp_path / 'mlruns'}",
        tensorboard_dir=blocker,
    )
    with (
        caplog.at_level(logging.ERROR, logger="fedlink.server.tracking.sinks"),
        CoordinatorThread(settings) as coordinator,
    ):
        job_id = _run_job(coordinator, cli_for(coordinator), tmp_path, rounds=3)
        shown = cli_for(coordinator)("job", "show", job_id)
    assert "FINISHED" in shown.stdout
    failures = [r for r in caplog.records if "TensorBoardSink failed" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in caplog.records]
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    experiment = client.get_experiment_by_name("fedlink")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert len(client.get_metric_history(run.info.run_id, "fedlink/num_results")) == 3


# ---- fedlink job plot ----------------------------------------------------------------------------------


def test_job_plot_draws_the_served_jobs_rounds(
    cli: Cli, coordinator: CoordinatorThread, tmp_path: Path
) -> None:
    job_id = _run_job(coordinator, cli, tmp_path, rounds=3)
    png = tmp_path / "curves.png"
    plotted = cli("job", "plot", job_id, "-o", str(png))
    assert plotted.exit_code == 0, plotted.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plotted 3 rounds of job {job_id}" in plotted.stdout
    wrong = cli("job", "plot", job_id, "-o", str(tmp_path / "curves.svg"))
    assert wrong.exit_code == 2 and "name the file *.png" in wrong.output
    missing = cli("job", "plot", "no-such-job", "-o", str(png))
    assert missing.exit_code == 1 and "NOT_FOUND" in missing.output


def test_job_plot_of_a_job_with_no_closed_round_says_so(cli: Cli, tmp_path: Path) -> None:
    job_id = submit(cli, write_job(tmp_path, rounds=2))  # no device: it waits for its first round
    plotted = cli("job", "plot", job_id, "-o", str(tmp_path / "p.png"))
    assert plotted.exit_code == 2
    assert "no round has closed" in plotted.output
    assert not (tmp_path / "p.png").exists()


def test_the_plot_has_integer_ticks_labels_with_units_a_title_and_a_line_per_metric() -> None:
    import matplotlib.pyplot as plt

    history = MetricHistory(title="digits", subtitle="job job-1")
    for step in range(1, 8):
        history.add(step, {"train_loss": 1 / step, "eval_loss": 1.2 / step, "train_accuracy": 1 - 0.5 / step})
    history.add(8, {"train_loss": 0.1, "eval_loss": float("nan"), "train_accuracy": 0.95, "lr": 0.5})
    figure = draw_history(history)
    try:
        loss, accuracy, other = figure.axes
        assert figure._suptitle.get_text() == "digits: metrics per round\njob job-1"
        assert sorted(line.get_label() for line in loss.get_lines()) == ["eval_loss", "train_loss"]
        assert [line.get_label() for line in accuracy.get_lines()] == ["train_accuracy"]
        assert [line.get_label() for line in other.get_lines()] == ["lr"]
        for axis in figure.axes:
            assert axis.get_xlabel() == "round (number)"
            assert "(" in axis.get_ylabel()  # the unit
            ticks = [t for t in axis.get_xticks() if 1 <= t <= 8]
            assert ticks and all(float(t).is_integer() for t in ticks), ticks
        assert accuracy.get_ylabel() == "accuracy (fraction correct, 0–1)"
        assert list(loss.get_lines()[0].get_xdata()) == list(range(1, 9))
    finally:
        plt.close(figure)
    single = MetricHistory.from_series("one", [5], {"train_loss": [0.5]}, step_name="version")
    figure = draw_history(single)
    try:
        (axis,) = figure.axes
        assert axis.get_xlabel() == "model version (number)"
        assert [t for t in axis.get_xticks() if 4.5 <= t <= 5.5] == [5.0]
    finally:
        plt.close(figure)


# ---- fedlink health -----------------------------------------------------------------------------------


def test_the_hand_built_health_messages_are_the_health_protos() -> None:
    from grpc_health.v1 import health_pb2

    for service in ("", "fedlink.v1.RunnerService"):
        assert encode_request(service) == health_pb2.HealthCheckRequest(service=service).SerializeToString()
    for status in (0, 1, 2, 3):
        wire = health_pb2.HealthCheckResponse(status=status).SerializeToString()
        assert decode_status(wire) == status
    with pytest.raises(ValueError):
        decode_status(b"\x08")  # a truncated varint


def test_health_says_serving_and_exits_0(cli: Cli) -> None:
    result = cli("health")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith(": SERVING")
    runner = cli("health", "--service", "fedlink.v1.RunnerService")
    assert runner.exit_code == 0 and "SERVING (fedlink.v1.RunnerService)" in runner.stdout
    unknown = cli("health", "--service", "no.such.Service")
    assert unknown.exit_code == 1 and "SERVICE_UNKNOWN" in unknown.stdout


def test_health_of_a_coordinator_that_is_not_serving_exits_1(
    cli: Cli, coordinator: CoordinatorThread
) -> None:
    from grpc_health.v1 import health_pb2

    running = coordinator.coordinator
    assert running is not None
    # What the coordinator itself does while its database is away or it stops (a private step, as
    # causing an outage here would take the test's store down with it).
    coordinator.submit(running._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)).result(timeout=10)
    result = cli("health")
    assert result.exit_code == 1
    assert result.stdout.strip() == f"{coordinator.address}: NOT_SERVING"


def test_health_of_an_unreachable_coordinator_exits_1_saying_so(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once closed
    result = Cli()("health", "--server", f"127.0.0.1:{port}", "--insecure", "--data-dir", str(tmp_path))
    assert result.exit_code == 1
    assert f"127.0.0.1:{port}: UNREACHABLE" in result.stderr


@pytest.mark.slow  # a CLI process
def test_health_works_over_tls_without_the_server_extra(tmp_path: Path) -> None:
    settings = CoordinatorSettings(data_dir=tmp_path / "data", listen_address="127.0.0.1:0")  # TLS
    with CoordinatorThread(settings) as coordinator:

        def health(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                tied(
                    [
                        sys.executable,
                        "-c",
                        WITHOUT_SERVER_EXTRA,
                        "health",
                        "--server",
                        coordinator.address,
                        *args,
                    ]
                ),
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
                cwd=tmp_path,
                env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
            )

        ok = health("--data-dir", str(settings.data_dir))  # trusts the data directory's CA
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.strip() == f"{coordinator.address}: SERVING"
        plaintext = health("--insecure")  # a plaintext client at a TLS server: no answer
        assert plaintext.returncode == 1
        assert "UNREACHABLE" in plaintext.stderr


# ---- the metrics endpoint -----------------------------------------------------------------------------


def test_the_metrics_endpoint_serves_metrics_and_404_elsewhere(tmp_path: Path) -> None:
    settings = dataclasses.replace(plaintext_settings(tmp_path / "data"), metrics_address="127.0.0.1:0")
    with CoordinatorThread(settings) as coordinator:
        assert coordinator.coordinator is not None
        url = coordinator.coordinator.metrics_url
        assert url is not None and url.endswith("/metrics")
        with urllib.request.urlopen(url, timeout=5) as response:
            assert response.status == 200
            assert b"fedlink_jobs{" in response.read()
        base = url.removesuffix("/metrics")
        for path in ("/", "/metrics/extra", "/metric", "/favicon.ico", "/anything?x=1"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(base + path, timeout=5)
            assert refused.value.code == 404, path
            assert b"/metrics" in refused.value.read()
            refused.value.close()
        with urllib.request.urlopen(url + "?name[]=fedlink_jobs", timeout=5) as response:
            assert response.status == 200  # a query on /metrics is still /metrics


def test_a_served_fedbuff_job_logs_its_model_versions_as_steps(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job_file = write_job(tmp_path, rounds=1)
    text = job_file.read_text()
    fedavg = text[text.index("[fedavg]") : text.index("[job_data]")]
    fedbuff = (
        "[fedbuff]\nmax_model_version = 3\ndevice_selection_size = 2\nnum_updates_for_model = 2\n"
        "max_model_history = 2\nmin_hole_to_fill = 1\nseed = 3\n\n"
    )
    job_file.write_text(text.replace(fedavg, fedbuff))
    settings = dataclasses.replace(plaintext_settings(tmp_path / "data"), tensorboard_dir=tmp_path / "tb")
    with CoordinatorThread(settings) as coordinator:
        cli = cli_for(coordinator)
        job_id = submit(cli, job_file)
        coordinator.submit(_devices_training(coordinator)).result(timeout=60)
        assert cli("job", "watch", job_id, "--no-results").exit_code == 0
        png = tmp_path / "versions.png"
        plotted = cli("job", "plot", job_id, "-o", str(png))
        assert plotted.exit_code == 0, plotted.output
        assert f"plotted 3 versions of job {job_id}" in plotted.stdout
    (folder,) = (tmp_path / "tb").iterdir()
    events = EventAccumulator(str(folder))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("fedlink/num_results")] == [
        (1, 2.0),
        (2, 2.0),
        (3, 2.0),
    ]
    assert [e.step for e in events.Scalars("train_loss")] == [1, 2, 3]


async def _devices_training(coordinator: CoordinatorThread) -> list[int]:
    async with grpc.aio.insecure_channel(coordinator.address) as channel:
        enrolled = [await StubDevice(channel).enroll() for _ in range(2)]
        return list(await asyncio.gather(*(d.train(1.0, loss=1.0) for d in enrolled)))
