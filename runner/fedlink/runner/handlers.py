"""Built-in event handlers."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fedlink.runner.context import Context, ContextKey, EventType

__all__ = ["LossRecord", "LossRecorder"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LossRecord:
    """One ``LOSS_GENERATED`` event."""

    task_id: str
    epoch: int
    iteration: int
    loss: float


class LossRecorder:
    """Keeps every ``LOSS_GENERATED`` event (and logs it at DEBUG); other events are ignored.

    ``records`` grows by one entry per epoch of every task; ``max_records`` keeps only the newest.
    """

    def __init__(self, max_records: int = 10_000) -> None:
        self.max_records = max_records
        self.records: list[LossRecord] = []

    def handle_event(self, event_type: str, event_data: Any, ctx: Context) -> None:
        """Record a loss event."""
        if event_type != EventType.LOSS_GENERATED or not isinstance(event_data, dict):
            return
        record = LossRecord(
            task_id=str(ctx.get(ContextKey.TASK_ID, "")),
            epoch=int(event_data.get("epoch", 0)),
            iteration=int(event_data.get("iter", 0)),
            loss=float(event_data["loss"]),
        )
        _log.debug("loss", extra={"task_id": record.task_id, "epoch": record.epoch, "loss": record.loss})
        self.records.append(record)
        del self.records[: -self.max_records]
