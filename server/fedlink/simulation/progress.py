"""What a running simulation shows: a live progress line, and a JSONL file of per-round metrics."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, Protocol

from fedlink.simulation.result import RoundRecord
from fedlink.simulation.transport import LiveCounts

__all__ = ["MetricsFile", "ProgressLine", "ProgressSink"]

#: Metrics shown on the progress line, in this order, when the rounds report them.
_SHOWN = ("train_loss", "train_accuracy", "eval_loss", "eval_accuracy", "val_loss", "val_accuracy")


class ProgressSink(Protocol):
    """Told what the simulation does, as it happens (all calls come from the simulation's event loop)."""

    def round_started(self, round: int, num_devices: int) -> None:
        """A round handed out its tasks to ``num_devices`` devices."""

    def round_closed(self, record: RoundRecord) -> None:
        """A round was aggregated and checkpointed."""

    def tick(self, counts: LiveCounts) -> None:
        """Called a few times a second with the live counts."""

    def close(self) -> None:
        """The simulation is over (whatever the outcome)."""


class ProgressLine:
    """One line on a terminal, rewritten in place: ``round 2/5 [#####.....] busy 8 ok 1532 ...``."""

    def __init__(self, num_rounds: int, num_devices: int, stream: IO[str] | None = None) -> None:
        self._rounds = num_rounds
        self._devices = num_devices
        self._stream = stream or sys.stderr
        self._round = 0
        self._closed = 0
        self._sampled = 0
        self._metrics: dict[str, float] = {}
        self._started = time.monotonic()
        self._width = 0

    def round_started(self, round: int, num_devices: int) -> None:
        self._round, self._sampled = round, num_devices

    def round_closed(self, record: RoundRecord) -> None:
        self._closed = record.round
        self._metrics = dict(record.metrics)

    def tick(self, counts: LiveCounts) -> None:
        bar_len = 20
        filled = round(bar_len * self._closed / self._rounds) if self._rounds else bar_len
        shown = " ".join(f"{k}={self._metrics[k]:.4g}" for k in _SHOWN if k in self._metrics)
        bar = "#" * filled + "." * (bar_len - filled)
        text = (
            f"round {max(self._round, self._closed)}/{self._rounds} [{bar}] "
            f"sampled {self._sampled}/{self._devices} busy {counts.busy} ok {counts.succeeded} "
            f"failed {counts.failed} dropped {counts.dropped} {time.monotonic() - self._started:.1f}s"
            + (f" | {shown}" if shown else "")
        )
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self._stream.write("\r" + text + " " * pad)
        self._stream.flush()

    def close(self) -> None:
        if self._width:
            self._stream.write("\n")
            self._stream.flush()


class MetricsFile:
    """Appends one JSON object per closed round to a file (written and flushed as each round closes).

    Each line: ``{"round", "num_devices", "num_results", "duration_s", "metrics": {...}}``.
    """

    def __init__(self, path: Path) -> None:
        self._file = path.open("w", encoding="utf-8")

    def round_started(self, round: int, num_devices: int) -> None:
        pass

    def round_closed(self, record: RoundRecord) -> None:
        line = asdict(record)
        line["metrics"] = dict(record.metrics)
        self._file.write(json.dumps(line, sort_keys=True) + "\n")
        self._file.flush()

    def tick(self, counts: LiveCounts) -> None:
        pass

    def close(self) -> None:
        self._file.close()
