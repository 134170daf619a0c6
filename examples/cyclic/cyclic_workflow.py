"""A workflow of one's own: cyclic (sequential) training, as NVIDIA FLARE's cyclic controller does it.

The model visits the job's devices one after another: device 1 trains it and reports, device 2 trains
the result, and so on; a round is one pass over the devices (in a seeded order that changes every
round). A device that fails, or does not report before ``task_timeout``, is skipped. Each round ends
with a checkpoint, so a restarted coordinator goes on from the last completed round.

Use it from a job file::

    [workflow]
    name = "cyclic_workflow:cyclic"
    config = { num_rounds = 3, min_devices = 3, task_timeout = 60.0, seed = 0 }

with the coordinator allowed to run it (``fedlink serve --allow-workflows cyclic_workflow``) and this
folder on its ``PYTHONPATH``. It uses only the documented :class:`WorkflowContext` methods
(``docs/workflows.md``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from fedlink.common.dxo import DXO, DataKind, MetaKey
from fedlink.server.domain import TRAIN_TASK, ResultStatus, Task
from fedlink.server.workflows.base import WorkflowContext

_KEYS = {"num_rounds", "min_devices", "task_timeout", "seed"}


@dataclass(frozen=True, slots=True)
class CyclicWorkflow:
    """Passes the model from device to device, ``num_rounds`` times over the devices."""

    num_rounds: int
    min_devices: int = 1
    task_timeout: float = 60.0
    seed: int = 0

    async def run(self, ctx: WorkflowContext) -> None:
        """Runs the rounds not yet checkpointed."""
        model = await ctx.load_model()
        version = int(ctx.state.get("version", 0))
        for round_no in range(ctx.completed + 1, self.num_rounds + 1):
            devices = await self._devices(ctx)
            order = np.random.default_rng([self.seed, round_no]).permutation(len(devices))
            await ctx.emit("round_started", round_no, {"num_devices": len(devices)})
            visited = 0
            for index in order:
                update = await self._visit(ctx, devices[int(index)], model, round_no, version)
                if update is None:
                    continue  # skipped: the next device trains the model as it is
                model = _applied(model, update, version + 1)
                version += 1
                visited += 1
            closed = ("round_closed", round_no, {"num_results": visited, "metrics": {}})
            await ctx.checkpoint(round_no, model, state={"version": version}, events=[closed])

    async def _devices(self, ctx: WorkflowContext) -> list[str]:
        devices = await ctx.eligible_devices()
        while len(devices) < self.min_devices:  # the job waits for its devices
            await ctx.wait_for_progress(1.0)
            devices = await ctx.eligible_devices()
        return devices

    async def _visit(
        self, ctx: WorkflowContext, device: str, model: DXO, round_no: int, version: int
    ) -> DXO | None:
        """Has ``device`` train ``model``; its update, or None if it failed or ran out of time."""
        (task,) = await ctx.hand_out(
            TRAIN_TASK, model, [device], round=round_no, due_in=timedelta(seconds=self.task_timeout),
            model_version=version,
        )  # fmt: skip
        while True:
            for result in await ctx.results([task]):
                if result.status is ResultStatus.SUCCEEDED and result.accepted:
                    return await ctx.read_result(result)
                return None
            if ctx.clock.now() >= task.deadline:
                await ctx.close_tasks([task])
                return None
            await ctx.wait_for_progress(_until(ctx, task))


def _until(ctx: WorkflowContext, task: Task) -> float:
    return max(0.0, min(1.0, (task.deadline - ctx.clock.now()).total_seconds()))


def _applied(model: DXO, update: DXO, version: int) -> DXO:
    """The model after one device's update: a WEIGHT_DIFF added, WEIGHTS taken as they are."""
    data = dict(model.data)
    for name, value in update.data.items():
        if update.kind is DataKind.WEIGHT_DIFF:
            data[name] = (model.data[name].astype(np.float64) + value).astype(model.data[name].dtype)
        else:
            data[name] = value
    return DXO(kind=DataKind.WEIGHTS, data=data, meta={MetaKey.MODEL_VERSION: version})


def cyclic(config: Mapping[str, Any]) -> CyclicWorkflow:
    """The workflow factory the job names (``cyclic_workflow:cyclic``); refuses a bad config."""
    unknown = sorted(set(config) - _KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(_KEYS))}")
    rounds = config.get("num_rounds")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"num_rounds must be a whole number >= 1, not {rounds!r}")
    minimum = config.get("min_devices", 1)
    if not isinstance(minimum, int) or isinstance(minimum, bool) or minimum < 1:
        raise ValueError(f"min_devices must be a whole number >= 1, not {minimum!r}")
    timeout = config.get("task_timeout", 60.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"task_timeout must be a positive number of seconds, not {timeout!r}")
    seed = config.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"seed must be a whole number, not {seed!r}")
    return CyclicWorkflow(num_rounds=rounds, min_devices=minimum, task_timeout=float(timeout), seed=seed)
