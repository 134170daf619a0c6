"""FedBuff's buffer: the accepted updates since the last global model, folded as they arrive.

The buffer keeps one sum per model version the updates were trained on (FLARE's per-version
aggregators), so memory grows with the model times the live versions, never with the number of
updates. When the workflow makes a new model from it, each version's sum is weighted by that version's
staleness and the weighted sum is divided once by the total weight (:meth:`UpdateBuffer.new_model`):

``delta = sum_v s(tau_v) * sum_{i in v} a_i * d_i  /  sum_v s(tau_v) * sum_{i in v} a_i``

where ``d_i`` is update i's difference to the model it was trained from, ``a_i`` its aggregation weight
(``num_examples``, or 1 for every device), ``tau_v`` the staleness of version ``v`` (the current
version minus ``v``) and ``s`` is 1, or ``1 / (1 + sqrt(tau))`` with staleness weighting. Each version
counts with its own updates' weight, not as one vote per version (NVIDIA/NVFlare#4899). The new model is
``model + global_lr * delta``, per variable, over the updates that carry it; a variable no update
carried keeps its value.

**Order.** Updates arrive in whatever order devices report. Each version's sum is a double-double
(a float64 pair, hi + lo, kept with Knuth's TwoSum): its error is about 2^-100 of the terms, so the
float64 value it rounds to, and hence the new model in its own dtype, does not depend on the order the
same updates came in, unless an element's exact value lies within that error of a rounding boundary.
A restarted coordinator folds the updates it reads back in another order than the one they arrived in
and still makes the model an uninterrupted run makes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedlink.server.domain.updates import VariableSpec
from fedlink.server.workflows.aggregation import STEP, difference
from fedlink.server.workflows.folding import MetricAverage


def two_sum(hi: float, lo: float, x: float) -> tuple[float, float]:
    """Adds ``x`` to the double-double ``hi + lo`` (Knuth's TwoSum); returns the new pair."""
    t = hi + x
    bp = t - hi
    return t, lo + ((hi - (t - bp)) + (x - bp))


def staleness_factor(staleness: int, *, weighted: bool) -> float:
    """The weight of an update ``staleness`` versions old: 1, or ``1 / (1 + sqrt(staleness))``."""
    return 1.0 / (1.0 + math.sqrt(staleness)) if weighted else 1.0


class VersionSum:
    """The weighted sum of the updates trained on one model version, per variable, in double-double."""

    def __init__(self) -> None:
        self._hi: dict[str, NDArray[np.float64]] = {}
        self._lo: dict[str, NDArray[np.float64]] = {}
        self._weights: dict[str, tuple[float, float]] = {}
        #: Updates folded in.
        self.count = 0

    def add(
        self,
        update: Mapping[str, NDArray[Any]],
        weight: float,
        *,
        minus: Mapping[str, NDArray[Any]] | None,
        scratch: _Scratch,
    ) -> None:
        """Folds ``update`` (minus ``minus``, the model it was trained from, for WEIGHTS) with ``weight``."""
        w = np.float64(weight)
        for name, array in update.items():
            hi = self._hi.get(name)
            if hi is None:
                hi = self._hi[name] = np.zeros(array.shape, dtype=np.float64)
                self._lo[name] = np.zeros(array.shape, dtype=np.float64)
                self._weights[name] = (0.0, 0.0)
            flat, his, los = array.reshape(-1), hi.reshape(-1), self._lo[name].reshape(-1)
            base = None if minus is None else minus[name].reshape(-1)
            for start in range(0, flat.size, STEP):
                part = flat[start : start + STEP]
                if base is not None:
                    part = difference(part, base[start : start + STEP], scratch.difference(part))
                _fold_block(part, w, his[start : start + STEP], los[start : start + STEP], scratch)
            self._weights[name] = two_sum(*self._weights[name], weight)
        self.count += 1

    def names(self) -> frozenset[str]:
        """The variables at least one update carried."""
        return frozenset(self._hi)

    def weight(self, name: str) -> float:
        """The total aggregation weight of the updates that carried ``name``."""
        hi, lo = self._weights[name]
        return hi + lo

    def block(self, name: str, start: int, out: NDArray[np.float64]) -> NDArray[np.float64]:
        """The sum of ``name``'s flattened elements from ``start`` (``out.size`` of them), into ``out``."""
        end = start + out.size
        return np.add(self._hi[name].reshape(-1)[start:end], self._lo[name].reshape(-1)[start:end], out=out)


class _Scratch:
    """Float64 blocks reused by every fold (a step's worth each)."""

    def __init__(self) -> None:
        self._blocks = [np.empty(STEP, dtype=np.float64) for _ in range(4)]
        self._differences: dict[np.dtype[Any], NDArray[Any]] = {}

    def blocks(self, size: int) -> list[NDArray[np.float64]]:
        return [b[:size] for b in self._blocks]

    def difference(self, part: NDArray[Any]) -> NDArray[Any]:
        buffer = self._differences.get(part.dtype)
        if buffer is None:
            buffer = self._differences[part.dtype] = np.empty(STEP, dtype=part.dtype)
        return buffer[: part.size]


def _fold_block(
    part: NDArray[Any], w: np.float64, hi: NDArray[np.float64], lo: NDArray[np.float64], scratch: _Scratch
) -> None:
    """``hi + lo += w * part``, elementwise TwoSum (no float64 temporaries beyond the scratch)."""
    x, t, bp, e = scratch.blocks(part.size)
    np.multiply(part, w, out=x)
    np.add(hi, x, out=t)  # t = hi + x
    np.subtract(t, hi, out=bp)  # bp = t - hi
    np.subtract(t, bp, out=e)  # e = t - bp
    np.subtract(hi, e, out=e)  # e = hi - (t - bp)
    np.subtract(x, bp, out=bp)  # bp = x - bp
    np.add(e, bp, out=e)  # e = the rounding error of hi + x
    np.add(lo, e, out=lo)
    np.copyto(hi, t)


class UpdateBuffer:
    """The updates accepted since the last global model, one :class:`VersionSum` per trained-on version."""

    def __init__(self, spec: Mapping[str, VariableSpec]) -> None:
        self._spec = dict(spec)
        self._versions: dict[int, VersionSum] = {}
        self._scratch = _Scratch()
        #: The updates' metrics, averaged with their aggregation weights.
        self.metrics = MetricAverage()

    @property
    def count(self) -> int:
        """How many updates the buffer holds."""
        return sum(v.count for v in self._versions.values())

    def versions(self) -> list[int]:
        """The model versions the buffered updates were trained on, oldest first."""
        return sorted(self._versions)

    def add(
        self,
        version: int,
        update: Mapping[str, NDArray[Any]],
        weight: float,
        *,
        minus: Mapping[str, NDArray[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        """Folds an update trained on ``version`` (already validated against the model) with ``weight``.

        ``minus``: the model the update was trained from, when the update is WEIGHTS (folded as its
        difference to it, rounded to the model's dtype, as FedAvg folds).
        """
        if not (weight > 0 and math.isfinite(weight)):
            raise ValueError(f"aggregation weight must be a positive finite number, got {weight}")
        found = self._versions.get(version)
        if found is None:
            found = self._versions[version] = VersionSum()
        found.add(update, weight, minus=minus, scratch=self._scratch)
        self.metrics.add(meta or {}, weight)

    def staleness(self, current: int) -> dict[int, int]:
        """How many buffered updates are how stale (``current`` minus their version), by staleness."""
        histogram: Counter[int] = Counter()
        for version, sums in self._versions.items():
            histogram[current - version] += sums.count
        return dict(sorted(histogram.items()))

    def new_model(
        self,
        model: Mapping[str, NDArray[Any]],
        *,
        current: int,
        global_lr: float,
        staleness_weight: bool,
    ) -> dict[str, NDArray[Any]]:
        """The next global model: ``model + global_lr * delta`` (see the module docstring), each variable
        computed in float64 a block at a time and rounded once into its dtype."""
        factors = {
            v: staleness_factor(current - v, weighted=staleness_weight) for v in sorted(self._versions)
        }
        out: dict[str, NDArray[Any]] = {}
        block = np.empty(STEP, dtype=np.float64)
        total = np.empty(STEP, dtype=np.float64)
        lr = np.float64(global_lr)
        for name, value in model.items():
            carrying = [(v, s) for v, s in sorted(self._versions.items()) if name in s.names()]
            if not carrying:
                out[name] = value
                continue
            weight = 0.0
            for v, sums in carrying:  # in version order: the same updates, the same total
                weight += factors[v] * sums.weight(name)
            new = np.empty(value.shape, dtype=value.dtype)
            flat_new, flat_value = new.reshape(-1), value.reshape(-1)
            for start in range(0, flat_value.size, STEP):
                size = min(STEP, flat_value.size - start)
                acc = total[:size]
                acc.fill(0.0)
                for v, sums in carrying:
                    part = sums.block(name, start, block[:size])
                    if factors[v] != 1.0:
                        np.multiply(part, factors[v], out=part)
                    np.add(acc, part, out=acc)
                np.divide(acc, weight, out=acc)
                if lr != 1.0:
                    np.multiply(acc, lr, out=acc)
                np.add(acc, flat_value[start : start + size], out=acc, dtype=np.float64)
                flat_new[start : start + size] = acc
            out[name] = new
        return out


__all__ = ["UpdateBuffer", "VersionSum", "staleness_factor", "two_sum"]
