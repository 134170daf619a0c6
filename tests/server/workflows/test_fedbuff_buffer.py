"""FedBuff's buffer: the new model from buffered updates of several versions, checked against numpy.

Each update is a float32 difference with its own aggregation weight; the expected model is computed
here in float64 from the formula of ``fedlink.server.workflows.buffer``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import pytest

from fedlink.server.domain.updates import model_spec
from fedlink.server.workflows.aggregation import WeightedAverage, apply_average
from fedlink.server.workflows.buffer import UpdateBuffer, staleness_factor

MODEL = {
    "w": np.linspace(-1, 1, 5000, dtype=np.float32).reshape(50, 100),
    "b": np.arange(7, dtype=np.float32),
}
#: (version trained on, seed, weight) of the buffered updates.
Update = tuple[int, int, float]


def _diff(seed: int, scale: float = 0.01) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(v.shape) * scale).astype(np.float32) for k, v in MODEL.items()}


def _buffer(updates: Sequence[Update]) -> UpdateBuffer:
    buffer = UpdateBuffer(model_spec(MODEL))
    for version, seed, weight in updates:
        buffer.add(version, _diff(seed), weight, meta={"loss": float(seed)})
    return buffer


def _expected(updates: Sequence[Update], *, current: int, lr: float, stale: bool) -> dict[str, np.ndarray]:
    out = {}
    for name, value in MODEL.items():
        total = np.zeros(value.shape, np.float64)
        weight = 0.0
        for version, seed, a in updates:
            s = 1.0 / (1.0 + math.sqrt(current - version)) if stale else 1.0
            total += s * a * _diff(seed)[name].astype(np.float64)
            weight += s * a
        out[name] = (value.astype(np.float64) + lr * total / weight).astype(np.float32)
    return out


def _new(
    buffer: UpdateBuffer, *, current: int, lr: float = 1.0, stale: bool = False
) -> dict[str, np.ndarray]:
    return buffer.new_model(MODEL, current=current, global_lr=lr, staleness_weight=stale)


def _close(ours: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert ours.keys() == expected.keys()
    for name, value in expected.items():
        assert ours[name].dtype == value.dtype
        # float32 rounding of the same float64 value: at most one ulp apart
        np.testing.assert_array_max_ulp(ours[name], value, maxulp=1)


UPDATES: list[Update] = [(3, 1, 10.0), (3, 2, 1.0), (4, 3, 5.0), (5, 4, 2.0), (5, 5, 7.0), (2, 6, 3.0)]


@pytest.mark.parametrize("stale", [False, True], ids=["unweighted", "staleness_weighted"])
@pytest.mark.parametrize("lr", [1.0, 0.05])
def test_the_new_model_is_the_staleness_weighted_mean_over_versions_times_the_global_lr(
    stale: bool, lr: float
) -> None:
    buffer = _buffer(UPDATES)
    _close(_new(buffer, current=5, lr=lr, stale=stale), _expected(UPDATES, current=5, lr=lr, stale=stale))


def test_staleness_weight_is_one_over_one_plus_the_root_of_the_staleness() -> None:
    assert staleness_factor(0, weighted=True) == 1.0
    assert staleness_factor(4, weighted=True) == pytest.approx(1 / 3)
    assert staleness_factor(9, weighted=False) == 1.0
    # an update of the current version with staleness weighting: weight 1, the same model as without
    only_current = [(5, 1, 2.0), (5, 2, 3.0)]
    assert _bits(_new(_buffer(only_current), current=5, stale=True)) == _bits(
        _new(_buffer(only_current), current=5, stale=False)
    )


def test_a_version_counts_with_its_updates_weight_not_as_one_vote_nvflare_4899() -> None:
    # 1 device on version 1 and 10 on version 2, all with the same update: FLARE's per-version averaging
    # gave version 1 half the say; here each device counts once.
    updates = [(1, 100, 1.0)] + [(2, 200, 1.0)] * 10
    new = _new(_buffer(updates), current=2)
    one, ten = _diff(100)["w"].astype(np.float64), _diff(200)["w"].astype(np.float64)
    want = (MODEL["w"].astype(np.float64) + (one + 10 * ten) / 11).astype(np.float32)
    np.testing.assert_array_max_ulp(new["w"], want, maxulp=1)
    equal_votes = (MODEL["w"].astype(np.float64) + (one + ten) / 2).astype(np.float32)
    assert not np.allclose(new["w"], equal_votes)


def _bits(model: dict[str, np.ndarray]) -> bytes:
    return b"".join(name.encode() + model[name].tobytes() for name in sorted(model))


def test_the_same_updates_in_any_order_give_the_same_bits() -> None:
    # large and small terms of both signs: a plain float64 sum would differ between these orders
    updates: list[Update] = [(v, seed, w) for v, seed, w in UPDATES]
    updates += [(4, 50 + i, float(1 + 13 * i)) for i in range(6)]
    first = _bits(_new(_buffer(updates), current=5, stale=True))
    rng = np.random.default_rng(0)
    for _ in range(20):
        order = list(rng.permutation(len(updates)))
        assert _bits(_new(_buffer([updates[i] for i in order]), current=5, stale=True)) == first


def test_a_float64_model_too_where_a_plain_float64_sum_would_depend_on_the_order() -> None:
    model = {"w": np.linspace(-1, 1, 20000)}
    spec = model_spec(model)
    rng = np.random.default_rng(1)
    updates = [(rng.standard_normal(20000) * 10.0 ** rng.integers(-3, 3), float(1 + i)) for i in range(12)]
    ours: set[bytes] = set()
    plain: set[bytes] = set()
    for order in itertools.islice(itertools.permutations(range(len(updates))), 0, 2000, 200):
        buffer = UpdateBuffer(spec)
        total, weight = np.zeros(20000), 0.0
        for i in order:
            diff, a = updates[i]
            buffer.add(i % 3, {"w": diff}, a)
            total += (1 / (1 + math.sqrt(3 - i % 3))) * a * diff
            weight += (1 / (1 + math.sqrt(3 - i % 3))) * a
        ours.add(buffer.new_model(model, current=3, global_lr=1.0, staleness_weight=True)["w"].tobytes())
        plain.add((model["w"] + total / weight).tobytes())
    assert len(plain) > 1  # the test can tell
    assert len(ours) == 1


def test_weights_updates_fold_as_their_difference_to_the_model_they_were_trained_from() -> None:
    old_model = {k: v + np.float32(0.5) for k, v in MODEL.items()}
    diff = _diff(9)
    weights = {k: old_model[k] + diff[k] for k in MODEL}
    as_weights = UpdateBuffer(model_spec(MODEL))
    as_weights.add(2, weights, 3.0, minus=old_model)
    as_diff = UpdateBuffer(model_spec(MODEL))
    as_diff.add(2, {k: np.subtract(weights[k], old_model[k]) for k in MODEL}, 3.0)
    assert _bits(_new(as_weights, current=3)) == _bits(_new(as_diff, current=3))


def test_a_variable_no_update_carried_keeps_its_value_and_each_is_averaged_over_those_that_do() -> None:
    buffer = UpdateBuffer(model_spec(MODEL))
    buffer.add(1, {"w": _diff(1)["w"]}, 2.0)
    buffer.add(1, _diff(2), 6.0)
    new = _new(buffer, current=1)
    want_b = (MODEL["b"].astype(np.float64) + _diff(2)["b"].astype(np.float64)).astype(np.float32)
    np.testing.assert_array_max_ulp(new["b"], want_b, maxulp=1)
    only_w = UpdateBuffer(model_spec(MODEL))
    only_w.add(1, {"w": _diff(1)["w"]}, 2.0)
    assert only_w.new_model(MODEL, current=1, global_lr=1.0, staleness_weight=False)["b"] is MODEL["b"]


def test_one_version_with_global_lr_one_is_fedavgs_weighted_mean() -> None:
    updates = [(0, seed, float(1 + 3 * seed)) for seed in range(10)]
    ours = _new(_buffer(updates), current=0)
    average = WeightedAverage(model_spec(MODEL))
    for _, seed, weight in updates:
        average.add(_diff(seed), weight)
    fedavg = apply_average(MODEL, average, is_diff=True)
    for name in MODEL:
        np.testing.assert_array_max_ulp(ours[name], np.asarray(fedavg[name], np.float32), maxulp=1)


def test_the_staleness_histogram_counts_updates_by_versions_behind_the_current_one() -> None:
    assert _buffer(UPDATES).staleness(5) == {0: 2, 1: 1, 2: 2, 3: 1}


def test_a_weight_that_is_not_positive_is_refused() -> None:
    buffer = UpdateBuffer(model_spec(MODEL))
    with pytest.raises(ValueError, match="positive"):
        buffer.add(0, _diff(1), 0.0)


def test_memory_grows_with_the_live_versions_not_with_the_updates() -> None:
    import tracemalloc

    def peak(updates: int) -> int:
        buffer = UpdateBuffer(model_spec(MODEL))
        diffs = [_diff(seed) for seed in range(3)]  # made before measuring
        tracemalloc.start()
        for i in range(updates):
            buffer.add(i % 3, diffs[i % 3], 1.0 + i)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert buffer.versions() == [0, 1, 2]
        return top

    model_bytes = sum(v.nbytes for v in MODEL.values())
    few, many = peak(6), peak(300)
    assert many < few + model_bytes  # 50 times the updates: not even one more model's worth
    assert few < 3 * 4 * model_bytes + 4 * 65536 * 8 + 100_000  # 3 versions x a float64 pair, + scratch
