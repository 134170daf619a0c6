"""The per-task context, its keys, the runner's event types and the abort signal."""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable
from typing import Any

from fedlink.common.errors import FailedPrecondition, FedlinkError

__all__ = ["Aborted", "Context", "ContextKey", "EventType", "Signal"]


class ContextKey(enum.StrEnum):
    """Well-known keys of a :class:`Context` (NVFlare edge names; members are plain strings)."""

    RUNNER = "runner"
    """The Runner driving this job."""
    DATA_SOURCE = "data_source"
    """The app's :class:`~fedlink.runner.spec.DataSource`."""
    COMPONENTS = "components"
    """Every component the job config built, by name."""
    EVENT_HANDLERS = "event_handlers"
    """The handlers :meth:`Context.fire_event` calls, in order."""
    TASK_ID = "task_id"
    TASK_NAME = "task_name"
    TASK_DATA = "task_data"
    """The task's input DXO, as received (before in-filters)."""
    EXECUTOR = "executor"
    """The executor chosen for the current task."""
    PARTITION_ID = "partition_id"
    """This device's data partition (the simulation gives virtual device i partition i)."""
    NUM_PARTITIONS = "num_partitions"
    """How many partitions the data is split into."""


class EventType(enum.StrEnum):
    """Events the runner and the built-in executors fire (NVFlare edge names and payloads)."""

    BEFORE_TRAIN = "before_train"
    """Fired before the executor runs; data is the wall-clock time (``time.time()``)."""
    AFTER_TRAIN = "after_train"
    """Fired after the executor returns; data is ``(time, output DXO)``."""
    LOSS_GENERATED = "loss_generated"
    """Fired by the built-in trainers once per epoch; data is ``{"loss", "epoch", "iter"}``."""


class Aborted(FedlinkError):
    """The task (or the whole runner) was told to stop; raised by :meth:`Signal.check`."""


class Signal:
    """A thread-safe, one-way abort flag shared by the runner and the code it calls.

    ``stop()`` on the runner triggers it; executors call :meth:`check` between batches so that a stop
    request takes effect within one batch.
    """

    __slots__ = ("_event", "_lock", "_reason")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._reason = ""

    def trigger(self, reason: str = "aborted") -> None:
        """Set the flag; the first reason given is kept."""
        with self._lock:
            if not self._event.is_set():
                self._reason = reason
                self._event.set()

    @property
    def triggered(self) -> bool:
        """Whether :meth:`trigger` has been called."""
        return self._event.is_set()

    @property
    def reason(self) -> str:
        """The reason given to the first :meth:`trigger` call ("" while not triggered)."""
        with self._lock:
            return self._reason

    def check(self) -> None:
        """Raise :class:`Aborted` if the signal has been triggered.

        Raises:
            Aborted: The signal was triggered; the message is its reason.
        """
        if self._event.is_set():
            raise Aborted(f"aborted: {self.reason}")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until triggered or ``timeout`` seconds pass; return whether it was triggered."""
        return self._event.wait(timeout)


class Context(dict[str, Any]):
    """A per-task, dict-like bag of what the runner knows (keys: :class:`ContextKey`, or your own).

    The runner makes one per job and a shallow copy per task, so an executor may add keys for the
    task's filters and handlers without them leaking into the next task.
    """

    def copy(self) -> Context:
        """A shallow copy, still a :class:`Context`."""
        return Context(self)

    def require(self, key: str) -> Any:
        """The value under ``key``.

        Raises:
            FailedPrecondition: The key is not set (the message names it).
        """
        try:
            return self[key]
        except KeyError:
            raise FailedPrecondition(f"the context has no {key!r}; the runner did not set it") from None

    def data_source(self) -> Any:
        """The device's data source (a :class:`~fedlink.runner.data.DataSource`).

        Raises:
            FailedPrecondition: The device has none (the message says where one comes from).
        """
        source = self.get(ContextKey.DATA_SOURCE)
        if source is None:
            raise FailedPrecondition(
                "this device has no data to train or evaluate on: give the runner --data (fedlink simulate:"
                " --data or [simulation] data), or name a data source in the trainer's args"
            )
        return source

    def fire_event(self, event_type: str, event_data: Any) -> None:
        """Call every handler under :attr:`ContextKey.EVENT_HANDLERS`, in order, with this context."""
        handlers: Iterable[Any] = self.get(ContextKey.EVENT_HANDLERS) or ()
        for handler in handlers:
            handler.handle_event(event_type, event_data, self)
