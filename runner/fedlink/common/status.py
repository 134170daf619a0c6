"""The device protocol's normal outcomes, shared by the coordinator and the runner."""

from __future__ import annotations

import enum


class DeviceStatus(enum.StrEnum):
    """The outcome of a device RPC when no fault occurred (the proto's ``RunnerStatus``)."""

    OK = "OK"
    RETRY = "RETRY"
    NO_JOB = "NO_JOB"
    NO_TASK = "NO_TASK"
    DONE = "DONE"
    STALE = "STALE"
