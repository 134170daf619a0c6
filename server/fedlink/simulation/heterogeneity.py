"""Per-device heterogeneity of a simulation: speed, drop-out and link delay, drawn reproducibly.

Every draw comes from a generator seeded with ``(seed, device index, round)``, so a device behaves the
same in the same round of two runs with the same seed, whatever order the devices happen to run in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedlink.common.errors import InvalidArgument

__all__ = ["DeviceRound", "Heterogeneity"]


@dataclass(frozen=True, slots=True)
class DeviceRound:
    """How one virtual device behaves in one round."""

    #: Work takes ``slowdown`` times as long as it did (1.0: as fast as the machine runs it).
    slowdown: float
    #: The device drops out of this round: it gives its task back without working on it.
    dropped: bool
    #: Seconds added to each message the device sends or receives in this round.
    link_delay_s: float


_NOMINAL = DeviceRound(slowdown=1.0, dropped=False, link_delay_s=0.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Heterogeneity:
    """How virtual devices differ. The default makes every device nominal (fast, reliable, no delay).

    A slowdown of ``s`` makes the device report ``s`` times later than its work took (the extra time
    is waited out on the event loop, not in a worker thread, so slow devices do not hold CPUs).
    """

    slowdown: tuple[float, float] = (1.0, 1.0)
    """Range ``(low, high)`` of the per-device, per-round slowdown factor, drawn log-uniformly; ≥ 1."""

    dropout: float = 0.0
    """Probability that a device drops out of a round (gives its task back unworked)."""

    link_delay_s: tuple[float, float] = (0.0, 0.0)
    """Range ``(low, high)`` in seconds of the delay added to each message, drawn uniformly."""

    def __post_init__(self) -> None:
        low, high = self.slowdown
        if not (math.isfinite(low) and math.isfinite(high) and 1.0 <= low <= high):
            raise InvalidArgument(
                f"heterogeneity.slowdown must be (low, high) with 1 <= low <= high, not {self.slowdown}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise InvalidArgument(f"heterogeneity.dropout must be in [0, 1), not {self.dropout}")
        low, high = self.link_delay_s
        if not (math.isfinite(low) and math.isfinite(high) and 0.0 <= low <= high):
            raise InvalidArgument(
                "heterogeneity.link_delay_s must be (low, high) with 0 <= low <= high, "
                f"not {self.link_delay_s}"
            )

    @property
    def nominal(self) -> bool:
        """True if no device differs from the machine (nothing to draw)."""
        return self.slowdown == (1.0, 1.0) and self.dropout == 0.0 and self.link_delay_s == (0.0, 0.0)

    def draw(self, seed: int, device: int, round: int) -> DeviceRound:
        """The behaviour of virtual device ``device`` in ``round``: a pure function of the arguments."""
        if self.nominal:
            return _NOMINAL
        rng = np.random.default_rng([seed & 0xFFFFFFFF, device, round])
        low, high = self.slowdown
        slowdown = float(math.exp(rng.uniform(math.log(low), math.log(high)))) if high > low else low
        dropped = bool(rng.random() < self.dropout)
        delay_low, delay_high = self.link_delay_s
        delay = float(rng.uniform(delay_low, delay_high)) if delay_high > delay_low else delay_low
        return DeviceRound(slowdown=slowdown, dropped=dropped, link_delay_s=delay)
