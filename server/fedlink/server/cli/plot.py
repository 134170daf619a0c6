"""Training curves as a PNG: ``fedlink simulate --plot`` and ``fedlink job plot`` (``fedlink[plot]``).

One figure, one panel per kind of metric, one line per metric: losses (``*loss*``), accuracies
(``*accuracy*``, ``*acc``), and every other metric together. The x axis is the round (or, for FedBuff, the
model version), with integer ticks; the title names the job. Needs matplotlib, drawn without a display.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import grpc

from fedlink.server.cli.client import (
    CALL_TIMEOUT_S,
    ConnectionOptions,
    ControlClient,
    connection_options,
    control_client,
    fail,
    output_file,
)
from fedlink.v1 import control_service_pb2 as cpb
from fedlink.v1 import states_pb2

__all__ = [
    "MetricHistory",
    "check_plotting",
    "draw_history",
    "history_from_events",
    "job_plot_command",
    "plot_history",
]

_FINAL_STATES = frozenset(
    {states_pb2.JOB_STATE_FINISHED, states_pb2.JOB_STATE_FAILED, states_pb2.JOB_STATE_ABORTED}
)
#: What ``pip install`` brings matplotlib in.
PLOT_EXTRA_HINT = "pip install 'fedlink[plot]'"


@dataclass(slots=True)
class MetricHistory:
    """Each metric's values over the steps (rounds or model versions) of one job."""

    #: The job's name, for the title.
    title: str
    #: A second title line (``job <id>``), or "".
    subtitle: str = ""
    #: ``round`` or ``version``.
    step_name: str = "round"
    #: The steps, increasing.
    steps: list[int] = field(default_factory=list)
    #: Metric name -> one value per step (NaN where the step lacks it).
    metrics: dict[str, list[float]] = field(default_factory=dict)

    def add(self, step: int, values: Mapping[str, float]) -> None:
        """Appends one step's metrics (a metric new at this step is NaN before it)."""
        for name in values:
            if name not in self.metrics:
                self.metrics[name] = [math.nan] * len(self.steps)
        self.steps.append(step)
        for name, series in self.metrics.items():
            series.append(float(values.get(name, math.nan)))

    @classmethod
    def from_series(
        cls,
        title: str,
        steps: Sequence[int],
        metrics: Mapping[str, Sequence[float]],
        *,
        step_name: str = "round",
        subtitle: str = "",
    ) -> MetricHistory:
        """A history from per-metric series aligned with ``steps``."""
        return cls(
            title=title,
            subtitle=subtitle,
            step_name=step_name,
            steps=list(steps),
            metrics={name: [float(v) for v in values] for name, values in metrics.items()},
        )


def check_plotting(option: str) -> None:
    """Stops the command (exit 2) if matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        fail(f"{option} needs matplotlib, which is not installed: {PLOT_EXTRA_HINT}")


def _panel(name: str) -> str:
    lowered = name.lower()
    if "loss" in lowered:
        return "loss"
    if "accuracy" in lowered or lowered.endswith("acc"):
        return "accuracy"
    return "other"


#: The x axis's label, by what a step is.
_X_LABELS = {"round": "round (number)", "version": "model version (number)"}
#: Each panel's y label, with its unit.
_Y_LABELS = {
    "loss": "loss (mean per example)",
    "accuracy": "accuracy (fraction correct, 0–1)",
    "other": "value (as the metric reports it)",
}


def plot_history(history: MetricHistory, path: Path) -> None:
    """Draws ``history`` (see :func:`draw_history`) into the PNG file ``path``.

    Raises:
        click.ClickException: nothing to draw (no step has a metric).
    """
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    figure = draw_history(history)
    try:
        figure.savefig(path, dpi=100)
    finally:
        plt.close(figure)


def draw_history(history: MetricHistory) -> Any:
    """The figure of ``history``: one line per metric, a panel per kind of metric (a matplotlib
    ``Figure``; close it with ``matplotlib.pyplot.close``).

    Metrics with no value at all (every step NaN) are left out.

    Raises:
        click.ClickException: nothing to draw (no step has a metric).
    """
    import matplotlib  # type: ignore[import-not-found, unused-ignore]  # optional: check_plotting first

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    from matplotlib.ticker import MaxNLocator  # type: ignore[import-not-found, unused-ignore]

    drawn = {k: v for k, v in history.metrics.items() if not all(math.isnan(x) for x in v)}
    if not history.steps or not drawn:
        fail(f"nothing to plot: {history.title} has no {history.step_name} with metrics yet")
    panels: dict[str, dict[str, list[float]]] = {}
    for name in sorted(drawn):
        panels.setdefault(_panel(name), {})[name] = drawn[name]
    order = [p for p in ("loss", "accuracy", "other") if p in panels]
    figure, axes = plt.subplots(1, len(order), figsize=(max(6.5, 5.5 * len(order)), 4.4), squeeze=False)
    marker = "o" if len(history.steps) <= 30 else None
    for axis, kind in zip(axes[0], order, strict=True):
        for name, values in panels[kind].items():
            axis.plot(history.steps, values, marker=marker, markersize=4, label=name)
        axis.set_xlabel(_X_LABELS.get(history.step_name, history.step_name))
        axis.set_ylabel(_Y_LABELS[kind])
        # Every panel spans every step (a metric reported once must not shrink its axis to a fraction
        # of a round), with integer ticks only: there is no round 2.5.
        axis.set_xlim(history.steps[0] - 0.5, history.steps[-1] + 0.5)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        if kind == "accuracy":
            low, high = axis.get_ylim()
            axis.set_ylim(max(0.0, low), min(1.0, high) + 0.02)
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    title = f"{history.title}: metrics per {history.step_name}"
    figure.suptitle(title + (f"\n{history.subtitle}" if history.subtitle else ""), fontsize=12)
    figure.tight_layout()
    return figure


def history_from_events(
    title: str, events: Iterable[cpb.WatchJobResponse], *, subtitle: str = ""
) -> MetricHistory:
    """A job's metric history from its ``WatchJob`` events (round_closed, or FedBuff's model_version)."""
    history = MetricHistory(title=title, subtitle=subtitle)
    for event in events:
        kind = event.WhichOneof("event")
        if kind == "round_closed":
            history.add(event.round, dict(event.round_closed.metrics))
        elif kind == "model_version":
            history.step_name = "version"
            history.add(
                event.round, {k: v for k, v in event.model_version.metrics.items() if k != "num_updates"}
            )
    return history


@click.command("plot")
@click.argument("job_id")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The PNG file to write (default: <job id>.png).",
)
@connection_options
def job_plot_command(job_id: str, output: Path | None, connection: ConnectionOptions) -> None:
    """Draw a job's metrics over its rounds (or model versions) into a PNG (needs fedlink[plot]).

    Reads the job's history from its events, as `fedlink job watch` does; for a running job, the
    rounds closed so far.
    """
    check_plotting("fedlink job plot")
    target = output_file(output, Path(f"{job_id}.png"), ".png", "the plot")
    with control_client(connection) as client:
        job = client.stub.DescribeJob(
            cpb.DescribeJobRequest(job_id=job_id), metadata=client.metadata, timeout=CALL_TIMEOUT_S
        ).job
        final = job.state in _FINAL_STATES
        if not final and job.completed_rounds == 0:
            state = states_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_")
            fail(f"nothing to plot yet: job {job_id} is {state} and no round has closed")
        events = _history_events(client, job_id, until_step=None if final else job.completed_rounds)
    history = history_from_events(job.spec.name, events, subtitle=f"job {job.job_id}")
    plot_history(history, target)
    click.echo(
        f"plotted {len(history.steps)} {history.step_name}s of job {job_id} "
        f"({', '.join(sorted(history.metrics))}) to {target}"
    )


def _history_events(
    client: ControlClient, job_id: str, *, until_step: int | None
) -> list[cpb.WatchJobResponse]:
    """The job's events from the first: all of a final job's, a running job's up to ``until_step``.

    WatchJob replays the history and then follows a running job, so the read stops at the step the
    job had completed when it was described; a deadline bounds a history that falls short of it (its
    events collected), and what came is used.
    """
    stream = client.stub.WatchJob(
        cpb.WatchJobRequest(job_id=job_id, after_sequence=0),
        metadata=client.metadata,
        timeout=CALL_TIMEOUT_S,
    )
    events: list[cpb.WatchJobResponse] = []
    try:
        for event in stream:
            events.append(event)
            step = event.WhichOneof("event") in ("round_closed", "model_version")
            if until_step is not None and step and event.round >= until_step:
                stream.cancel()
                break
    except grpc.RpcError as exc:
        if not (isinstance(exc, grpc.Call) and exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and events):
            raise
    return events
