"""Per-device heterogeneity of a simulation: speed, drop-out and link delay, drawn reproducibly.

Every draw comes from a generator seeded with ``(seed, device index, round)``, so a device behaves the
same in the same round of two runs with the same seed, whatever order the devices happen to run in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

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
    #: Simulated seconds the task's work takes on this device in this round (the device reports no
    #: sooner); None: as long as the machine took, times ``slowdown``.
    compute_s: float | None = None
    #: The device takes its task and goes away for good: it never reports and asks for nothing more.
    vanished: bool = False


_NOMINAL = DeviceRound(slowdown=1.0, dropped=False, link_delay_s=0.0)
#: The "round" of the draw of a device's speed factor, which holds for all its rounds (no round reaches it).
_PER_DEVICE = 0xFFFFFFFF


@dataclass(frozen=True, slots=True, kw_only=True)
class Heterogeneity:
    """How virtual devices differ. The default makes every device nominal (fast, reliable, no delay).

    A slowdown of ``s`` makes the device report ``s`` times later than its work took (the extra time
    is waited out on the event loop, not in a worker thread, so slow devices do not hold CPUs). With
    ``compute_time_s`` the device reports when its drawn compute time has passed since it took the task
    (or when its work is done, if that took longer).
    """

    slowdown: tuple[float, float] = (1.0, 1.0)
    """Range ``(low, high)`` of the per-device, per-round slowdown factor, drawn log-uniformly; ≥ 1."""

    dropout: float = 0.0
    """Probability that a device drops out of a round (gives its task back unworked)."""

    link_delay_s: tuple[float, float] = (0.0, 0.0)
    """Range ``(low, high)`` in seconds of the delay added to each message, drawn uniformly."""

    compute_time_s: tuple[float, float] | None = None
    """``(median, sigma)`` of a log-normal compute time per task in seconds (sigma of the log; a
    sigma near 1 gives a heavy tail); the task takes ``speed × slowdown × draw`` simulated seconds
    instead of as long as the machine takes. None: the machine's time, times the slowdown."""

    speed_sigma: float = 0.0
    """Sigma of the log of a per-device speed factor (log-normal, median 1), drawn once per device and
    kept for all its rounds: a slow device stays slow. Scales ``compute_time_s``; 0: all alike."""

    vanish: float = 0.0
    """Probability that a device, having taken its task in a round, goes away for good: it never
    reports (its lease runs out, as a phone's that was switched off does) and takes no more tasks."""

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
        if self.compute_time_s is not None:
            median, sigma = self.compute_time_s
            if not (math.isfinite(median) and math.isfinite(sigma) and median > 0.0 and sigma >= 0.0):
                raise InvalidArgument(
                    "heterogeneity.compute_time_s must be (median, sigma) with median > 0 and sigma >= 0, "
                    f"not {self.compute_time_s}"
                )
        if not 0.0 <= self.vanish < 1.0:
            raise InvalidArgument(f"heterogeneity.vanish must be in [0, 1), not {self.vanish}")
        if not (math.isfinite(self.speed_sigma) and self.speed_sigma >= 0.0):
            raise InvalidArgument(f"heterogeneity.speed_sigma must be >= 0, not {self.speed_sigma}")
        if self.speed_sigma > 0.0 and self.compute_time_s is None:
            raise InvalidArgument("heterogeneity.speed_sigma scales compute_time_s: give compute_time_s too")

    @classmethod
    def from_table(cls, table: Mapping[str, Any], where: str = "simulation.heterogeneity") -> Heterogeneity:
        """The heterogeneity a job file's ``[simulation.heterogeneity]`` table gives (its keys are the
        field names; a pair is a two-element array, e.g. ``compute_time_s = [2.0, 1.0]``).

        Raises:
            InvalidArgument: an unknown key, a value of the wrong shape, or one out of range.
        """
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(table) - set(names))
        if unknown:
            raise InvalidArgument(
                f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(names)}"
            )
        values: dict[str, Any] = {}
        for key, value in table.items():
            if key in ("dropout", "speed_sigma", "vanish"):
                if isinstance(value, bool) or not isinstance(value, int | float):
                    raise InvalidArgument(f"{where}.{key} must be a number, not {value!r}")
                values[key] = float(value)
            else:
                ok = isinstance(value, list | tuple) and len(value) == 2
                if not ok or any(isinstance(v, bool) or not isinstance(v, int | float) for v in value):
                    raise InvalidArgument(f"{where}.{key} must be a pair of numbers [a, b], not {value!r}")
                values[key] = (float(value[0]), float(value[1]))
        try:
            return cls(**values)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{where}: {exc.message}") from None

    @property
    def nominal(self) -> bool:
        """True if no device differs from the machine (nothing to draw)."""
        return (
            self.slowdown == (1.0, 1.0)
            and self.dropout == 0.0
            and self.link_delay_s == (0.0, 0.0)
            and self.compute_time_s is None
            and self.vanish == 0.0
        )

    def speed(self, seed: int, device: int) -> float:
        """The speed factor of virtual device ``device`` (its compute times' multiplier; 1: median)."""
        if self.speed_sigma == 0.0:
            return 1.0
        rng = np.random.default_rng([seed & 0xFFFFFFFF, device, _PER_DEVICE])
        return float(rng.lognormal(0.0, self.speed_sigma))

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
        compute: float | None = None
        if self.compute_time_s is not None:  # drawn last: the draws above stay those of older runs
            median, sigma = self.compute_time_s
            compute = self.speed(seed, device) * slowdown * float(rng.lognormal(math.log(median), sigma))
        vanished = bool(rng.random() < self.vanish) if self.vanish > 0.0 else False  # last, as above
        return DeviceRound(
            slowdown=slowdown, dropped=dropped, link_delay_s=delay, compute_s=compute, vanished=vanished
        )
