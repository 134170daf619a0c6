"""``fedlink simulate``: run a job file on N virtual devices on this machine and summarize the result."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import numpy as np

from fedlink.common.errors import FedlinkError
from fedlink.server.cli.client import fail
from fedlink.server.cli.jobfile import SimulationSection
from fedlink.server.cli.plot import MetricHistory, check_plotting, plot_history
from fedlink.server.tracking import TrackingConfig

if TYPE_CHECKING:
    from fedlink.simulation import SimulationJob


def _backend_config(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        fail(f"--backend-config must be a JSON object, e.g. '{{\"num_cpus\": 2}}': {exc}")
    if not isinstance(value, dict):
        fail("--backend-config must be a JSON object, e.g. '{\"num_cpus\": 2}'")
    return value


def _with_data_flags(
    job: SimulationJob,
    *,
    data: Path | None,
    partition: str | None,
    partition_alpha: float | None,
    partition_seed: int | None,
) -> SimulationJob:
    """``job`` with its ``[simulation]`` data and split replaced by the flags that were given."""
    section = job.simulation or SimulationSection()
    if data is not None:
        if not data.is_file():
            fail(f"--data: data file {data} does not exist")
        section = dataclasses.replace(section, data=data.resolve())
    if partition is not None:
        section = dataclasses.replace(section, partition="dirichlet" if partition == "dirichlet" else "iid")
    if partition_alpha is not None:
        section = dataclasses.replace(section, partition_alpha=partition_alpha)
    if partition_seed is not None:
        section = dataclasses.replace(section, partition_seed=partition_seed)
    return dataclasses.replace(job, simulation=section)


def _tracking(
    job: SimulationJob, uri: str | None, experiment: str | None, tensorboard_dir: Path | None
) -> TrackingConfig:
    """The job file's [tracking] section with the flags that were given in its place."""
    base = job.tracking or TrackingConfig()
    if uri is not None:
        base = dataclasses.replace(base, mlflow_tracking_uri=uri)
    if experiment is not None:
        base = dataclasses.replace(base, mlflow_experiment=experiment)
    if tensorboard_dir is not None:
        base = dataclasses.replace(base, tensorboard_dir=tensorboard_dir)
    return base


@click.command("simulate")
@click.argument("job_file", type=click.Path(path_type=Path, dir_okay=False))
@click.option(
    "--devices",
    "-n",
    type=click.IntRange(min=1),
    help="Virtual devices to run (default: the job file's [simulation] devices).",
)
@click.option(
    "--data",
    type=click.Path(path_type=Path, dir_okay=False),
    help="An .npz file (x_train/y_train...) every device gets its partition of, as fedlink runner "
    "--data --partition-id I --num-partitions N does (replaces [simulation] data).",
)
@click.option(
    "--partition",
    type=click.Choice(["iid", "dirichlet"]),
    help="How --data is split ([simulation] partition).",
)
@click.option("--partition-alpha", type=float, help="Dirichlet concentration (smaller: more skew).")
@click.option("--partition-seed", type=int, help="Seed of the split.")
@click.option(
    "--backend",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="Where tasks run: local (threads here) or ray (Ray actors; needs fedlink[ray]).",
)
@click.option(
    "--transport",
    type=click.Choice(["inprocess", "grpc"]),
    default="inprocess",
    show_default=True,
    help="How devices reach the coordinator: in-process calls, or real gRPC on loopback.",
)
@click.option(
    "--backend-config",
    metavar="JSON",
    help='Backend settings, e.g. \'{"num_cpus": 2, "client_resources": {"num_cpus": 1}}\' '
    "(ray also: address, actor_count).",
)
@click.option("--seed", type=int, help="Replaces the job's FedAvg seed (sampling, heterogeneity draws).")
@click.option(
    "--jsonl", type=click.Path(path_type=Path, dir_okay=False), help="Write per-round metrics here."
)
@click.option(
    "--plot",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Draw metrics over rounds into this PNG (needs fedlink[plot]).",
)
@click.option(
    "--mlflow-tracking-uri",
    metavar="URI",
    help="Log each round's metrics to an MLflow run here: file:./mlruns, sqlite:///mlflow.db, ... "
    "(needs fedlink[mlflow]; replaces [tracking] mlflow_tracking_uri).",
)
@click.option(
    "--mlflow-experiment", metavar="NAME", help="The MLflow experiment (default: fedlink, or [tracking]'s)."
)
@click.option(
    "--tensorboard-dir",
    type=click.Path(path_type=Path, file_okay=False),
    help="Write TensorBoard event files under this folder (needs fedlink[tensorboard]; replaces "
    "[tracking] tensorboard_dir).",
)
@click.option(
    "--store", type=click.Path(path_type=Path, dir_okay=False), help="Keep the state store in this new file."
)
@click.option(
    "--save-model", type=click.Path(path_type=Path, dir_okay=False), help="Save the final model (.npz)."
)
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), help="Abort after this many seconds.")
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a live progress line.")
def simulate_command(
    job_file: Path,
    devices: int | None,
    data: Path | None,
    partition: str | None,
    partition_alpha: float | None,
    partition_seed: int | None,
    backend: str,
    transport: str,
    backend_config: str | None,
    seed: int | None,
    jsonl: Path | None,
    plot: Path | None,
    mlflow_tracking_uri: str | None,
    mlflow_experiment: str | None,
    tensorboard_dir: Path | None,
    store: Path | None,
    save_model: Path | None,
    timeout: float | None,
    progress: bool,
) -> None:
    """Run JOB_FILE (the format of ``fedlink job submit``) on N virtual devices, with the real
    coordinator and runner code in this process, and print a summary.

    Virtual device i gets partition i of N of --data (or the job file's [simulation] data), split
    as [simulation] says and as `fedlink runner` splits it. The job's component types may be the
    user's own (pkg.module:Name), imported from the installed packages or from modules beside the
    job file: a simulation runs the user's own code, so every module is allowed.
    """
    from fedlink.simulation import SimulationError, SimulationJob, run_simulation

    if plot is not None:
        check_plotting("--plot")
    try:
        job = _with_data_flags(
            SimulationJob.from_file(job_file),
            data=data,
            partition=partition,
            partition_alpha=partition_alpha,
            partition_seed=partition_seed,
        )
        if devices is None:
            devices = job.simulation.devices if job.simulation is not None else None
        if devices is None:
            fail(f"how many devices? give --devices N, or devices = N in {job_file}'s [simulation] section")
        # After the installed packages: a module beside the job file does not shadow one of theirs.
        beside = str(job_file.resolve().parent)
        sys.path.append(beside)
        try:
            result = run_simulation(
                job,
                devices,
                backend=backend,
                transport=transport,
                backend_config=_backend_config(backend_config),
                seed=seed,
                store=store if store is not None else ":memory:",
                progress=progress,
                metrics_jsonl=jsonl,
                tracking=_tracking(job, mlflow_tracking_uri, mlflow_experiment, tensorboard_dir),
                timeout=timeout,
            )
        finally:
            sys.path.remove(beside)
    except SimulationError as exc:
        cause = f" (caused by {type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
        fail(f"simulation failed: {exc}{cause}")
    except FedlinkError as exc:
        fail(str(exc))
    click.echo(result.summary())
    if save_model is not None:
        with save_model.open("wb") as file:
            np.savez(file, allow_pickle=False, **result.arrays)
        click.echo(f"final model saved to {save_model}")
    if jsonl is not None:
        click.echo(f"per-round metrics written to {jsonl}")
    if plot is not None:
        history = MetricHistory.from_series(
            job.name,
            [r.round for r in result.rounds],
            result.metrics,
            step_name="version" if job.spec.name == "fedbuff" else "round",
            subtitle=f"simulated job {result.job_id} on {result.num_devices} virtual devices",
        )
        plot_history(history, plot)
        click.echo(f"metrics plotted to {plot}")
    if result.store_url:
        click.echo(f"state store kept at {result.store_url}")
