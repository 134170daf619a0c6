"""Streaming weighted averaging: exact weights, partial updates, canonical bits, bad input refused."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from fedlink.common.errors import InvalidArgument
from fedlink.server.domain.updates import model_spec
from fedlink.server.workflows.aggregation import WeightedAverage, apply_average, difference


def _model() -> dict[str, np.ndarray]:
    return {"w": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.float32)}


def test_weighted_mean_of_diffs_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    model = _model()
    updates = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in model.items()} for _ in range(5)]
    weights = [1.0, 2.0, 3.0, 4.0, 10.0]
    avg = WeightedAverage(model_spec(model))
    for u, w in zip(updates, weights, strict=True):
        avg.add(u, w)
    new = apply_average(model, avg, is_diff=True)
    for name in model:
        expected = np.zeros(model[name].shape, np.float64)
        for u, w in zip(updates, weights, strict=True):
            expected += w * u[name].astype(np.float64)
        expected /= sum(weights)
        np.testing.assert_array_equal(new[name], expected.astype(np.float32))
        assert new[name].dtype == np.float32


def test_variables_are_averaged_over_the_results_that_carry_them() -> None:
    model = _model()
    avg = WeightedAverage(model_spec(model))
    avg.add({"w": np.ones((3, 2), np.float32), "b": np.full(2, 4, np.float32)}, 1.0)
    avg.add({"w": np.full((3, 2), 3, np.float32)}, 1.0)  # "b" excluded by a filter
    new = apply_average(model, avg, is_diff=True)
    np.testing.assert_array_equal(new["w"], np.full((3, 2), 2, np.float32))
    np.testing.assert_array_equal(new["b"], np.full(2, 4, np.float32))


def test_uncovered_variables_keep_their_value() -> None:
    model = {"w": np.ones(2, np.float32), "frozen": np.full(3, 7, np.float32)}
    avg = WeightedAverage(model_spec(model))
    avg.add({"w": np.ones(2, np.float32)}, 2.0)
    new = apply_average(model, avg, is_diff=False)
    np.testing.assert_array_equal(new["frozen"], model["frozen"])
    np.testing.assert_array_equal(new["w"], np.ones(2, np.float32))


def test_same_inputs_in_the_same_order_give_the_same_bits() -> None:
    rng = np.random.default_rng(1)
    model = {"w": np.zeros(1000, np.float32)}
    updates = [{"w": rng.normal(size=1000).astype(np.float32)} for _ in range(20)]
    outs = []
    for _ in range(2):
        avg = WeightedAverage(model_spec(model))
        for i, u in enumerate(updates):
            avg.add(u, float(i + 1))
        outs.append(apply_average(model, avg, is_diff=True)["w"].tobytes())
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({"w": np.zeros((2, 3), np.float32)}, "shape"),
        ({"w": np.zeros((3, 2), np.float64)}, "dtype"),
        ({"nope": np.zeros(2, np.float32)}, "not part of the model"),
        ({"w": np.full((3, 2), np.nan, np.float32)}, "NaN"),
        ({"b": np.array([np.inf, 0], np.float32)}, "NaN or Inf"),
        ({}, "no variables"),
    ],
)
def test_bad_updates_are_refused_and_leave_the_aggregate_untouched(
    update: dict[str, np.ndarray], message: str
) -> None:
    model = _model()
    avg = WeightedAverage(model_spec(model))
    avg.add({"w": np.ones((3, 2), np.float32)}, 1.0)
    with pytest.raises(InvalidArgument, match=message):
        avg.add(update, 1.0)
    assert avg.count == 1
    np.testing.assert_array_equal(apply_average(model, avg, is_diff=True)["w"], np.ones((3, 2), np.float32))


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_weights_are_refused(weight: float) -> None:
    avg = WeightedAverage(model_spec(_model()))
    with pytest.raises(InvalidArgument, match="weight"):
        avg.add({"w": np.ones((3, 2), np.float32)}, weight)


def test_stepwise_folding_gives_the_bits_of_whole_array_float64_math() -> None:
    # Sizes around and above the fold's step (65,536 elements), odd shapes, and the dtypes whose
    # difference is taken natively (float32, float64) or through float64 (float16).
    rng = np.random.default_rng(11)
    model: dict[str, np.ndarray] = {
        "big": rng.standard_normal((3, 70_001)).astype(np.float32),
        "f64": rng.standard_normal(65_537),
        "f16": rng.standard_normal(1000).astype(np.float16),
    }
    updates = [
        {
            k: (v + rng.standard_normal(v.shape).astype(v.dtype) * 0.01).astype(v.dtype)
            for k, v in model.items()
        }
        for _ in range(4)
    ]
    weights = [1.0, 3.0, 0.5, 7.0]
    avg = WeightedAverage(model_spec(model))
    for update, weight in zip(updates, weights, strict=True):
        avg.add(update, weight, minus=model)
    for name, base in model.items():
        total = np.zeros(base.shape, np.float64)
        for update, weight in zip(updates, weights, strict=True):
            diff = np.subtract(update[name], base, dtype=np.float64).astype(base.dtype)
            total += diff.astype(np.float64) * np.float64(weight)
        np.testing.assert_array_equal(avg.result()[name], total / sum(weights))
        assert difference(updates[0][name], base).dtype == base.dtype


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "int32", "bfloat16"])
@pytest.mark.parametrize("is_diff", [True, False])
def test_the_new_model_has_the_bits_of_whole_array_float64_math(dtype: str, is_diff: bool) -> None:
    # Stepwise into the new array, it must round exactly as (current.astype(float64) + mean).astype(dtype)
    # (or mean.astype(dtype)) did; sizes span several steps and end in a partial one.
    kind = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(7)
    shape = (3, (1 << 16) // 3 + 1001)

    def array() -> np.ndarray:
        values = rng.normal(scale=50.0, size=shape)
        return values.astype(kind)

    current = {"w": array(), "untouched": array()}
    average = WeightedAverage(model_spec(current))
    for weight in (1.0, 3.0, 7.5):
        average.add({"w": array()}, weight)
    expected_mean = average.result()["w"]
    expected = (current["w"].astype(np.float64) + expected_mean if is_diff else expected_mean).astype(kind)

    new = apply_average(current, average, is_diff=is_diff)
    assert new["w"].dtype == kind and new["w"].shape == shape
    assert new["w"].tobytes() == expected.tobytes()
    assert new["untouched"] is current["untouched"]
    assert average.result()["w"].tobytes() == expected_mean.tobytes()  # the sums are left as they were
