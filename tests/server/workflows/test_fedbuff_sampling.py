"""FedBuff's refill sampling over the listed eligible devices, without a walk of all of them: the busy
devices, the used ones and the tiers of used ones by count are kept as tasks are handed out and end,
and match what a rebuild from scratch makes of the same history."""

from __future__ import annotations

from collections import Counter

import numpy as np

from fedlink.server.workflows.device_pool import DevicePool
from fedlink.server.workflows.fedavg import sample_devices


def _name(i: int) -> str:
    return f"d{i:05d}"


def _listed(count: int, uses: Counter[str] | None = None, busy: set[str] | None = None) -> DevicePool:
    candidates = DevicePool()
    candidates.rebuild([_name(i) for i in range(count)], uses or Counter(), busy or set())
    return candidates


def _rng(wave: int = 0) -> np.random.Generator:
    return np.random.default_rng([7, 1, wave])


def test_with_nothing_excluded_random_picks_are_fedavgs_sample() -> None:
    candidates = _listed(1_000)
    picked = candidates.sample(40, balanced=False, reuse=True, rng=_rng(3))
    assert picked == sample_devices(candidates.devices, 40, seed=7, round=1, wave=3)


def test_random_picks_skip_the_selection_and_are_the_ith_free_devices() -> None:
    busy = {_name(i) for i in (0, 1, 2, 10, 11, 49)}
    candidates = _listed(50, Counter(busy), busy)
    free = [d for d in candidates.devices if d not in busy]
    assert candidates.usable(reuse=True) == len(free)
    # Asked for all of them, a refill gets every free device, in id order.
    assert candidates.sample(100, balanced=False, reuse=True, rng=_rng()) == free
    for wave in range(20):
        picked = candidates.sample(5, balanced=False, reuse=True, rng=_rng(wave))
        expected = [free[i] for i in sorted(_rng(wave).choice(len(free), size=5, replace=False))]
        assert picked == expected


def test_balanced_takes_unused_devices_first_then_the_least_used() -> None:
    uses = Counter({_name(i): n for i, n in enumerate([3, 1, 2, 1]) if n})
    candidates = _listed(10, uses)
    unused = [_name(i) for i in range(4, 10)]
    picked = candidates.sample(4, balanced=True, reuse=True, rng=_rng())
    assert set(picked) <= set(unused) and len(set(picked)) == 4
    # Six unused, then the two used once (d1, d3), not d2 (twice) nor d0 (three times).
    picked = candidates.sample(8, balanced=True, reuse=True, rng=_rng())
    assert picked == sorted([*unused, "d00001", "d00003"])
    # A device in the selection is never picked again, however little it was used.
    candidates.taken("d00001", uses["d00001"])
    uses["d00001"] += 1
    picked = candidates.sample(8, balanced=True, reuse=True, rng=_rng())
    assert picked == sorted([*unused, "d00002", "d00003"])
    # Its task over, it has been used twice: it ties with d2, and either may come after d3.
    candidates.freed("d00001", uses["d00001"])
    assert candidates.sample(9, balanced=True, reuse=True, rng=_rng()) == sorted(
        [*unused, "d00001", "d00002", "d00003"]
    )
    seen = set()
    for wave in range(20):
        picked = candidates.sample(8, balanced=True, reuse=True, rng=_rng(wave))
        [tied] = set(picked) - {*unused, "d00003"}
        seen.add(tied)
    assert seen == {"d00001", "d00002"}


def test_without_reuse_only_never_used_devices_are_picked() -> None:
    uses = Counter({_name(i): 1 for i in range(0, 20, 2)})
    candidates = _listed(20, uses)
    assert candidates.usable(reuse=False) == 10
    for balanced in (False, True):
        picked = candidates.sample(20, balanced=balanced, reuse=False, rng=_rng())
        assert picked == [_name(i) for i in range(1, 20, 2)]


def test_the_kept_lists_match_a_rebuild_after_any_history() -> None:
    rng = np.random.default_rng(11)
    devices = 200
    candidates = _listed(devices)
    uses: Counter[str] = Counter()
    holding: list[str] = []
    for step in range(2_000):
        if holding and (len(holding) >= 50 or rng.random() < 0.5):
            device = holding.pop(int(rng.integers(len(holding))))
            candidates.freed(device, uses[device])
        else:
            for device in candidates.sample(int(rng.integers(1, 4)), balanced=True, reuse=True, rng=rng):
                candidates.taken(device, uses[device])
                uses[device] += 1
                holding.append(device)
        if step % 97 == 0:
            fresh = _listed(devices, uses, set(holding))
            assert candidates._used_at == fresh._used_at, step
            assert candidates._busy_at == fresh._busy_at, step
            assert {n: t for n, t in candidates._tiers.items() if t} == fresh._tiers, step
    assert len(set(holding)) == len(holding)  # a busy device is never picked again
    # Balanced: counts stay within one of each other once every device was used.
    assert max(uses.values()) - min(uses[_name(i)] for i in range(devices)) <= 2
