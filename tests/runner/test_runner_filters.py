"""Tests of the built-in filters: Gaussian DP, float16 marking, top-k sparsification, exclusion."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from fedlink.common.dxo import DXO, DataKind
from fedlink.common.errors import InvalidArgument
from fedlink.common.tensors import TensorEncoding
from fedlink.runner import Aborted, Context, ContextKey, Signal
from fedlink.runner.filters import ExcludeVariables, Float16Compression, GaussianPrivacy, TopKSparsification


def _diff(**data: npt.NDArray[Any]) -> DXO:
    return DXO(kind=DataKind.WEIGHT_DIFF, data=data, meta={"num_examples": 10})


def _norm(dxo: DXO) -> float:
    return float(np.sqrt(sum(np.sum(np.square(v.astype(np.float64))) for v in dxo.data.values())))


def _wire(dxo: DXO) -> DXO:
    """What the coordinator decodes after the transport encodes ``dxo``."""
    return DXO.from_bytes(dxo.to_bytes())


@pytest.fixture
def big_update() -> DXO:
    rng = np.random.default_rng(0)
    return _diff(a=rng.normal(0, 1, (300, 400)).astype(np.float32), b=rng.normal(0, 1, 80_000))


def test_dp_clips_a_large_update_to_exactly_clip_norm(big_update: DXO) -> None:
    before = _norm(big_update)
    out = GaussianPrivacy(clip_norm=2.5, noise_multiplier=0.0).filter(big_update, Context(), Signal())
    assert before > 100
    assert _norm(out) == pytest.approx(2.5, rel=1e-5)
    # Clipping scales every variable by the same factor: directions are kept.
    np.testing.assert_allclose(out.data["b"], big_update.data["b"] * 2.5 / before, rtol=1e-6)
    assert out.meta["dp_update_norm"] == pytest.approx(before)
    assert out.meta["num_examples"] == 10


def test_dp_leaves_a_small_update_unscaled() -> None:
    small = _diff(w=np.full(4, 0.1, np.float32))
    out = GaussianPrivacy(clip_norm=1.0, noise_multiplier=0.0).filter(small, Context(), Signal())
    np.testing.assert_array_equal(out.data["w"], small.data["w"])


def test_dp_noise_has_the_promised_std_and_meta_is_recorded(big_update: DXO) -> None:
    clip, multiplier = 1.0, 0.5
    dp = GaussianPrivacy(clip_norm=clip, noise_multiplier=multiplier, seed=11)
    out = dp.filter(big_update, Context(), Signal())
    scale = clip / _norm(big_update)
    noise = np.concatenate(
        [(out.data[n].astype(np.float64) - big_update.data[n] * scale).ravel() for n in ("a", "b")]
    )
    # 200,000 draws: the sample std is within ~0.3% of the truth; the mean within ~0.005.
    assert noise.std() == pytest.approx(multiplier * clip, rel=0.01)
    assert abs(noise.mean()) < 0.01
    assert out.meta["dp_clip_norm"] == clip
    assert out.meta["dp_noise_multiplier"] == multiplier
    assert out.meta["dp_noise_std"] == pytest.approx(0.5)
    assert {v.dtype for v in out.data.values()} == {np.dtype(np.float32), np.dtype(np.float64)}
    assert out.data["a"].dtype == np.float32


def test_dp_is_reproducible_with_a_seed_and_fresh_without(big_update: DXO) -> None:
    def run(seed: int | None, partition: int = 0) -> bytes:
        ctx = Context({ContextKey.PARTITION_ID: partition})
        return GaussianPrivacy(1.0, 1.0, seed=seed).filter(big_update, ctx, Signal()).to_bytes()

    assert run(5) == run(5)
    assert run(5) != run(5, partition=1)
    assert run(None) != run(None)


def test_dp_does_not_change_its_input(big_update: DXO) -> None:
    copy = {n: v.copy() for n, v in big_update.data.items()}
    GaussianPrivacy(1.0, 1.0, seed=1).filter(big_update, Context(), Signal())
    for name, value in copy.items():
        np.testing.assert_array_equal(big_update.data[name], value)


def test_dp_refuses_weights_and_passes_metrics_through() -> None:
    dp = GaussianPrivacy(1.0)
    with pytest.raises(InvalidArgument, match="not to WEIGHTS"):
        dp.filter(DXO(kind=DataKind.WEIGHTS, data={"w": np.ones(3)}), Context(), Signal())
    metrics = DXO(kind=DataKind.METRICS, data={"loss": np.asarray(0.5)})
    assert dp.filter(metrics, Context(), Signal()) is metrics


@pytest.mark.parametrize(
    ("args", "message"),
    [({"clip_norm": 0}, "clip_norm"), ({"clip_norm": 1, "noise_multiplier": -1}, "noise_multiplier")],
)
def test_dp_args_are_validated(args: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        GaussianPrivacy(**args)


def test_filters_check_the_abort_signal(big_update: DXO) -> None:
    signal = Signal()
    signal.trigger("stop")
    with pytest.raises(Aborted):
        GaussianPrivacy(1.0).filter(big_update, Context(), signal)


def test_float16_marks_eligible_float_variables_and_leaves_values_alone() -> None:
    rng = np.random.default_rng(2)
    dxo = _diff(
        f32=rng.normal(size=(10, 10)).astype(np.float32),
        f64=rng.normal(size=7),
        f16=np.ones(3, np.float16),
        ints=np.arange(5),
        huge=np.array([1e6, 1.0], np.float32),
        sparse=np.array([0.0, 2.0, 0.0], np.float32),
    )
    dxo.encodings["sparse"] = TensorEncoding.SPARSE
    out = Float16Compression().filter(dxo, Context(), Signal())
    assert out.encodings == {"f32": TensorEncoding.FLOAT16, "f64": TensorEncoding.FLOAT16, "sparse": "sparse"}
    assert out.meta["float16_variables"] == 2
    assert all(out.data[n] is dxo.data[n] for n in dxo.data)
    assert dxo.encodings == {"sparse": TensorEncoding.SPARSE}  # the input is not changed
    decoded = _wire(out)
    np.testing.assert_array_equal(decoded.data["f32"], dxo.data["f32"].astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(decoded.data["huge"], dxo.data["huge"])


def test_top_k_keeps_exactly_the_k_largest_magnitudes_and_marks_them_sparse() -> None:
    rng = np.random.default_rng(3)
    dxo = _diff(w=rng.normal(size=(40, 25)).astype(np.float32), b=rng.normal(size=8), ints=np.arange(4))
    out = TopKSparsification(k=10).filter(dxo, Context(), Signal())
    for name in ("w", "b"):
        kept = np.flatnonzero(out.data[name])
        assert len(kept) == min(10, dxo.data[name].size)
        threshold = np.sort(np.abs(dxo.data[name].ravel()))[-len(kept)]
        assert np.all(np.abs(dxo.data[name].ravel()[kept]) >= threshold)
        np.testing.assert_array_equal(out.data[name].ravel()[kept], dxo.data[name].ravel()[kept])
        assert out.encodings[name] == TensorEncoding.SPARSE
        assert out.data[name].shape == dxo.data[name].shape
    assert "ints" not in out.encodings
    assert out.meta["topk_kept"] == {"w": 10, "b": 8}
    assert out.meta["topk_fraction_kept"] == pytest.approx(18 / 1008)
    assert np.count_nonzero(dxo.data["w"]) == 1000  # the input is not changed
    np.testing.assert_array_equal(_wire(out).data["w"], out.data["w"])


def test_top_k_by_fraction_rounds_up_and_keeps_at_least_one() -> None:
    rng = np.random.default_rng(4)
    dxo = _diff(w=rng.normal(size=1001).astype(np.float32), tiny=np.array([0.5, -3.0], np.float32))
    out = TopKSparsification(fraction=0.01).filter(dxo, Context(), Signal())
    assert np.count_nonzero(out.data["w"]) == 11
    np.testing.assert_array_equal(out.data["tiny"], [0.0, -3.0])
    assert out.meta["topk_kept"] == {"w": 11, "tiny": 1}


def test_top_k_refuses_weights_and_bad_args() -> None:
    with pytest.raises(InvalidArgument, match="not to WEIGHTS"):
        TopKSparsification(k=1).filter(
            DXO(kind=DataKind.WEIGHTS, data={"w": np.ones(3)}), Context(), Signal()
        )
    with pytest.raises(InvalidArgument, match="exactly one of k or fraction"):
        TopKSparsification()
    with pytest.raises(InvalidArgument, match="exactly one of k or fraction"):
        TopKSparsification(k=1, fraction=0.5)
    with pytest.raises(InvalidArgument, match="fraction"):
        TopKSparsification(fraction=1.5)


def test_exclude_removes_exactly_the_matching_variables() -> None:
    names = ["conv1.weight", "conv1.bias", "head.weight", "head.bias", "bn.running_mean", "fc2.weight"]
    dxo = DXO(kind=DataKind.WEIGHTS, data={n: np.ones(2, np.float32) for n in names})
    dxo.encodings["head.bias"] = TensorEncoding.FLOAT16
    dxo.encodings["conv1.bias"] = TensorEncoding.FLOAT16
    flt = ExcludeVariables(names=["fc2.weight", "absent"], globs=["head.*"], regexes=[r"bn\..*"])
    out = flt.filter(dxo, Context(), Signal())
    assert sorted(out.data) == ["conv1.bias", "conv1.weight"]
    assert out.encodings == {"conv1.bias": TensorEncoding.FLOAT16}
    assert out.meta["excluded_variables"] == ["bn.running_mean", "fc2.weight", "head.bias", "head.weight"]
    assert len(dxo.data) == 6  # the input is not changed
    # Regexes match the whole name, globs too: "conv1" alone matches nothing.
    assert ExcludeVariables(regexes=["conv1"], globs=["conv1"]).filter(
        dxo, Context(), Signal()
    ).data.keys() == (dxo.data.keys())


def test_exclude_refuses_to_remove_everything_and_bad_patterns() -> None:
    dxo = _diff(a=np.ones(2), b=np.ones(2))
    with pytest.raises(InvalidArgument, match="every variable"):
        ExcludeVariables(globs=["*"]).filter(dxo, Context(), Signal())
    with pytest.raises(InvalidArgument, match="bad regular expression"):
        ExcludeVariables(regexes=["("])
    with pytest.raises(InvalidArgument, match="at least one"):
        ExcludeVariables()
    with pytest.raises(InvalidArgument, match="names must be a list of strings"):
        ExcludeVariables(names="head")
