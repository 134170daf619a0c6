"""What a simulation returns (:class:`SimulationResult`) and raises (:class:`SimulationError`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from fedlink.common.dxo import DXO
from fedlink.common.errors import FedlinkError

__all__ = ["Failure", "RoundRecord", "SimulationError", "SimulationResult"]


class SimulationError(FedlinkError):
    """The simulation could not finish: the workflow failed, it timed out, or the job was aborted.

    ``__cause__`` is the workflow's own exception when it was captured (its traceback included).
    """

    def __init__(self, message: str, *, job_state: str = "", rounds_done: int = 0) -> None:
        super().__init__(message)
        #: The job's final state (FAILED, ABORTED) or "" if it never got one (time-out).
        self.job_state = job_state
        #: Rounds that closed before the end.
        self.rounds_done = rounds_done


@dataclass(frozen=True, slots=True, kw_only=True)
class Failure:
    """A task that a virtual device reported as failed."""

    device: int
    round: int
    task_name: str
    #: The exception's type and message, as the Runner reported it.
    cause: str


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundRecord:
    """One closed round."""

    round: int
    #: Devices sampled when the round started.
    num_devices: int
    #: Results aggregated.
    num_results: int
    #: The workflow's metrics: ``train_loss``/``train_accuracy`` (and ``val_*``) averaged over the
    #: results weighted by their examples, ``eval_*`` when the job evaluates, and anything else the
    #: results carried in their metadata.
    metrics: Mapping[str, float]
    #: Seconds from the round's start to its close (aggregation and checkpoint included).
    duration_s: float
    #: Seconds from the job's first event to the round's close (FedBuff: the version's making), on
    #: the coordinator's clock: simulated seconds under ``time_scale`` (see :mod:`fedlink.simulation.clock`).
    virtual_time_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SimulationResult:
    """The outcome of :func:`~fedlink.simulation.run_simulation`."""

    #: The final global model (kind WEIGHTS).
    model: DXO = field(repr=False)
    rounds: tuple[RoundRecord, ...]
    #: Device index -> the rounds in which its training result was aggregated.
    participation: Mapping[int, tuple[int, ...]] = field(repr=False)
    failures: tuple[Failure, ...]
    #: ``(device index, round)`` of every simulated drop-out.
    dropouts: tuple[tuple[int, int], ...]
    num_devices: int
    job_id: str
    #: The state store URL when it was kept (``store=`` a file), else "" (in memory, gone).
    store_url: str
    #: Seconds spent enrolling the virtual devices and submitting the job.
    setup_s: float
    #: Seconds from the call to its return.
    wall_time_s: float
    #: ``(device index, round)`` of every device that took a task and went away for good (``vanish``).
    vanished: tuple[tuple[int, int], ...] = ()

    @property
    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        """The final model's variables (writable copies)."""
        return {name: np.array(value) for name, value in self.model.data.items()}

    @property
    def metrics(self) -> dict[str, list[float]]:
        """Each metric's values over the rounds (NaN where a round lacks it), for plotting."""
        names = sorted({name for r in self.rounds for name in r.metrics})
        return {name: [float(r.metrics.get(name, float("nan"))) for r in self.rounds] for name in names}

    def summary(self) -> str:
        """A few lines for people: rounds, the last metrics, timings, failures."""
        lines = [
            f"{len(self.rounds)} rounds on {self.num_devices} virtual devices in {self.wall_time_s:.2f}s "
            f"(setup {self.setup_s:.2f}s)"
        ]
        for record in self.rounds:
            shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(record.metrics.items()))
            lines.append(
                f"  round {record.round}: {record.num_results}/{record.num_devices} results in "
                f"{record.duration_s:.2f}s" + (f"; {shown}" if shown else "")
            )
        taking_part = sum(1 for rounds in self.participation.values() if rounds)
        lines.append(f"devices whose results were aggregated: {taking_part} of {self.num_devices}")
        if self.dropouts:
            lines.append(f"simulated drop-outs: {len(self.dropouts)}")
        if self.failures:
            lines.append(f"failed tasks: {len(self.failures)}")
            for failure in self.failures[:5]:
                lines.append(f"  device {failure.device}, round {failure.round}: {failure.cause}")
            if len(self.failures) > 5:
                lines.append(f"  ... and {len(self.failures) - 5} more (SimulationResult.failures)")
        return "\n".join(lines)
