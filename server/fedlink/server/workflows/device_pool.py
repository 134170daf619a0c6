"""The eligible devices a FedBuff selection is refilled from, sampled without a walk of all of them."""

from __future__ import annotations

import asyncio
import bisect
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from fedlink.server.workflows.base import WorkflowContext


class DevicePool:
    """The eligible devices as last read (sorted by id), sampled from without a walk of all of them.

    Devices are kept as positions in that sorted list: the devices used so far, those holding a task
    now (busy), and the used ones not busy by how many tasks they had (tiers), each a sorted list kept
    up to date as tasks are handed out and end. A refill excludes the busy devices (and, without
    ``device_reuse``, or for ``balanced`` sampling's least-used tier, every device used so far): the
    ``i``-th device not excluded is found by a walk of the exclusions, and ``balanced`` takes the rest
    from the lowest tiers, so a sample of ``k`` costs O(k + exclusions), never O(devices). The lists
    are rebuilt only when the eligible devices are read again (every few seconds).
    """

    def __init__(self) -> None:
        self.devices: list[str] = []
        self.read_at = -math.inf
        #: Positions in ``devices`` of the devices used so far, sorted.
        self._used_at: list[int] = []
        #: Positions of the devices holding a task, sorted; and how many tasks each holds (by id).
        self._busy_at: list[int] = []
        self._busy: Counter[str] = Counter()
        #: Per use count (>= 1), the sorted positions of the devices used that often and not busy.
        self._tiers: dict[int, list[int]] = {}

    def position(self, device: str) -> int | None:
        at = bisect.bisect_left(self.devices, device)
        return at if at < len(self.devices) and self.devices[at] == device else None

    async def refresh(
        self, ctx: WorkflowContext, uses: Counter[str], busy: Callable[[], Iterable[str]], *, max_age: float
    ) -> None:
        """Reads the eligible devices again if the list is older than ``max_age`` seconds."""
        loop = asyncio.get_running_loop()
        if loop.time() - self.read_at < max_age:
            return
        self.rebuild(await ctx.eligible_devices(), uses, busy())
        self.read_at = loop.time()

    def rebuild(self, devices: Sequence[str], uses: Counter[str], busy: Iterable[str]) -> None:
        """Lists ``devices`` (sorted by id) with their ``uses`` so far and the ``busy`` ones."""
        self.devices = list(devices)
        self._busy = Counter(busy)
        self._used_at = self.positions(d for d, n in uses.items() if n)
        self._busy_at = self.positions(self._busy)
        self._tiers = {}
        for at in self._used_at:
            device = self.devices[at]
            if device not in self._busy:
                self._tiers.setdefault(uses[device], []).append(at)  # in position order already

    def taken(self, device: str, uses_before: int) -> None:
        """``device`` was handed a task; it had ``uses_before`` tasks of the run before."""
        self._busy[device] += 1
        at = self.position(device)
        if at is None:
            return
        if uses_before == 0:
            bisect.insort(self._used_at, at)
        if self._busy[device] == 1:
            bisect.insort(self._busy_at, at)
            if uses_before:
                _discard(self._tiers.get(uses_before, []), at)

    def freed(self, device: str, uses: int) -> None:
        """A task of ``device`` ended; it had ``uses`` tasks of the run."""
        if self._busy[device] > 1:
            self._busy[device] -= 1
            return
        self._busy.pop(device, None)
        at = self.position(device)
        if at is None:
            return
        _discard(self._busy_at, at)
        if uses:
            bisect.insort(self._tiers.setdefault(uses, []), at)

    def positions(self, devices: Iterable[str]) -> list[int]:
        """The sorted positions of those of ``devices`` that are listed."""
        return sorted(at for d in devices if (at := self.position(d)) is not None)

    def usable(self, *, reuse: bool) -> int:
        """How many listed devices a refill may pick (the selection's devices are used ones)."""
        return len(self.devices) - (len(self._busy_at) if reuse else len(self._used_at))

    def pick(self, excluded_at: Sequence[int], k: int, rng: np.random.Generator) -> list[str]:
        """``k`` listed devices not at ``excluded_at`` (sorted positions), uniformly, in id order."""
        free = len(self.devices) - len(excluded_at)
        chosen = range(free) if k >= free else sorted(int(i) for i in rng.choice(free, size=k, replace=False))
        picked: list[str] = []
        skip = 0
        for i in chosen:  # the i-th free position: i plus the exclusions at or before it
            while skip < len(excluded_at) and excluded_at[skip] <= i + skip:
                skip += 1
            picked.append(self.devices[i + skip])
        return picked

    def sample(self, k: int, *, balanced: bool, reuse: bool, rng: np.random.Generator) -> list[str]:
        """``k`` devices for a refill (see FedBuff's ``_sample``)."""
        if not balanced:
            return self.pick(self._busy_at if reuse else self._used_at, k, rng)
        picked = self.pick(self._used_at, k, rng)  # the least used tier: devices with no task yet
        if len(picked) >= k or not reuse:
            return picked
        # Every unused device is taken: the rest from the fewest uses up, uniformly within a tier.
        for count in sorted(self._tiers):
            tier = self._tiers[count]
            need = k - len(picked)
            if need >= len(tier):
                picked += (self.devices[at] for at in tier)
            else:
                picked += (
                    self.devices[tier[int(i)]] for i in sorted(rng.choice(len(tier), need, replace=False))
                )
            if len(picked) >= k:
                break
        return sorted(picked)


def _discard(positions: list[int], at: int) -> None:
    """Removes ``at`` from the sorted ``positions`` if it is there."""
    i = bisect.bisect_left(positions, at)
    if i < len(positions) and positions[i] == at:
        del positions[i]


__all__ = ["DevicePool"]
