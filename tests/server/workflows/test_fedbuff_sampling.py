"""FedBuff's refill sampling over the listed eligible devices, without a walk of all of them."""

from __future__ import annotations

from collections import Counter

import numpy as np

from fedlink.server.workflows.fedavg import sample_devices
from fedlink.server.workflows.fedbuff import _Candidates


def _listed(count: int) -> _Candidates:
    candidates = _Candidates()
    candidates.devices = [f"d{i:05d}" for i in range(count)]
    return candidates


def _rng(wave: int = 0) -> np.random.Generator:
    return np.random.default_rng([7, 1, wave])


def test_with_nothing_excluded_random_picks_are_fedavgs_sample() -> None:
    candidates = _listed(1_000)
    picked = candidates.sample(40, set(), Counter(), balanced=False, reuse=True, rng=_rng(3))
    assert picked == sample_devices(candidates.devices, 40, seed=7, round=1, wave=3)


def test_random_picks_skip_the_selection_and_are_the_ith_free_devices() -> None:
    candidates = _listed(50)
    busy = {f"d{i:05d}" for i in (0, 1, 2, 10, 11, 49)}
    for device in sorted(busy):
        candidates.note_used(device)
    free = [d for d in candidates.devices if d not in busy]
    assert candidates.usable(busy, reuse=True) == len(free)
    # Asked for all of them, a refill gets every free device, in id order.
    assert candidates.sample(100, busy, Counter(busy), balanced=False, reuse=True, rng=_rng()) == free
    for wave in range(20):
        picked = candidates.sample(5, busy, Counter(busy), balanced=False, reuse=True, rng=_rng(wave))
        expected = [free[i] for i in sorted(_rng(wave).choice(len(free), size=5, replace=False))]
        assert picked == expected


def test_balanced_takes_unused_devices_first_then_the_least_used() -> None:
    candidates = _listed(10)
    uses: Counter[str] = Counter()
    for i, count in enumerate([3, 1, 2, 1, 0, 0, 0, 0, 0, 0]):
        if count:
            candidates.note_used(f"d{i:05d}")
            uses[f"d{i:05d}"] = count
    unused = [f"d{i:05d}" for i in range(4, 10)]
    picked = candidates.sample(4, set(), uses, balanced=True, reuse=True, rng=_rng())
    assert set(picked) <= set(unused) and len(set(picked)) == 4
    # Six unused, then the two used once (d1, d3), not d2 (twice) nor d0 (three times).
    picked = candidates.sample(8, set(), uses, balanced=True, reuse=True, rng=_rng())
    assert picked == sorted([*unused, "d00001", "d00003"])
    # A device in the selection is never picked again, however little it was used.
    picked = candidates.sample(8, {"d00001"}, uses, balanced=True, reuse=True, rng=_rng())
    assert picked == sorted([*unused, "d00002", "d00003"])


def test_without_reuse_only_never_used_devices_are_picked() -> None:
    candidates = _listed(20)
    uses = Counter({f"d{i:05d}": 1 for i in range(0, 20, 2)})
    for device in uses:
        candidates.note_used(device)
    assert candidates.usable(set(), reuse=False) == 10
    for balanced in (False, True):
        picked = candidates.sample(20, set(), uses, balanced=balanced, reuse=False, rng=_rng())
        assert picked == [f"d{i:05d}" for i in range(1, 20, 2)]
