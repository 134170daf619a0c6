"""The tasks this process created or read, shared by the workflows and the device protocol."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TypeVar

from fedlink.server.domain import Task

_V = TypeVar("_V")
#: Tasks kept by KnownTasks (a round of 10,000 devices is 10,000 tasks).
_KNOWN_TASKS = 100_000


def remember(cache: OrderedDict[str, _V], key: str, value: _V, limit: int) -> None:
    """Puts ``key`` in a bounded cache, dropping the oldest entry when it is full.

    An OrderedDict, not a dict: ``dict.pop(next(iter(d)))`` walks the holes the earlier pops left at
    the front of the dict's entry table, so a full cache of 100,000 spent O(evicted) per eviction
    (seconds per round at 100,000 devices); ``popitem(last=False)`` is O(1).
    """
    if key not in cache and len(cache) >= limit:
        cache.popitem(last=False)
    cache[key] = value


class KnownTasks:
    """Tasks by id, as this process created or read them, shared by the workflows and the device protocol.

    What the device protocol reads of a task (its name, payload, job, round) never changes; its state is
    checked by the store where it matters (claims, reports). A workflow adds the tasks it creates, so
    the devices that claim them are answered without reading them back.
    """

    def __init__(self, limit: int = _KNOWN_TASKS) -> None:
        self._limit = limit
        self._tasks: OrderedDict[str, Task] = OrderedDict()

    def get(self, task_id: str) -> Task | None:
        """The task, if known."""
        return self._tasks.get(task_id)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._tasks

    def add(self, tasks: Sequence[Task]) -> None:
        """Keeps ``tasks`` (the oldest known ones go first once ``limit`` are kept)."""
        for task in tasks:
            remember(self._tasks, task.task_id, task, self._limit)
