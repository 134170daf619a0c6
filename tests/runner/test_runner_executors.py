"""Tests of the built-in numpy trainers: learning, FedProx, WEIGHT_DIFF semantics, determinism, evaluation."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from fedlink.common.dxo import DXO, DataKind, MetaKey, weight_of
from fedlink.common.errors import FailedPrecondition, InvalidArgument
from fedlink.runner import Aborted, Context, ContextKey, EventType, Signal
from fedlink.runner.data import ArrayDataSource
from fedlink.runner.executors import LinearRegressionTrainer, MLPTrainer, SoftmaxRegressionTrainer
from fedlink.runner.handlers import LossRecorder
from fedlink.runner.spec import DataSource

from .conftest import Split

Weights = dict[str, npt.NDArray[Any]]


def _ctx(
    source: DataSource, task: str = "train", *, handlers: list[Any] | None = None, partition: int = 0
) -> Context:
    return Context(
        {
            ContextKey.DATA_SOURCE: source,
            ContextKey.TASK_NAME: task,
            ContextKey.EVENT_HANDLERS: handlers or [],
            ContextKey.PARTITION_ID: partition,
        }
    )


def _meta(dxo: DXO, key: str) -> float:
    value = dxo.meta[key]
    assert isinstance(value, float), f"meta {key!r} = {value!r}"
    return value


def _weights(data: Weights) -> DXO:
    return DXO(kind=DataKind.WEIGHTS, data=data)


def _apply(global_weights: Weights, diff: DXO) -> Weights:
    assert diff.kind == DataKind.WEIGHT_DIFF
    return {name: global_weights[name] + diff.data[name] for name in global_weights}


def _logits(w: Weights, x: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """The models' forward pass, written out independently of the trainers."""
    if "w1" in w:
        return np.asarray(np.maximum(x @ w["w1"] + w["b1"], 0) @ w["w2"] + w["b2"])
    return np.asarray(x @ w["weight"] + w["bias"])


def _regression_data(n: int = 600, seed: int = 1) -> tuple[npt.NDArray[Any], npt.NDArray[Any], Weights]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype(np.float32)
    true = {"weight": rng.normal(size=(5, 1)).astype(np.float32), "bias": np.array([0.5], np.float32)}
    y = (x @ true["weight"] + true["bias"]).ravel() + rng.normal(0, 0.05, n).astype(np.float32)
    return x, y, true


def test_linear_regression_learns_the_true_weights_and_the_loss_decreases() -> None:
    x, y, true = _regression_data()
    source = ArrayDataSource({"train": (x, y)})
    recorder = LossRecorder()
    ctx = _ctx(source, handlers=[recorder])
    initial = LinearRegressionTrainer.init_weights(5, 1)
    result = LinearRegressionTrainer(epochs=8, batch_size=16, learning_rate=0.05).execute(
        _weights(initial), ctx, Signal()
    )
    trained = _apply(initial, result)
    losses = [r.loss for r in recorder.records]
    assert len(losses) == 8 and losses[-1] < losses[0] / 10
    np.testing.assert_allclose(trained["weight"], true["weight"], atol=0.02)
    np.testing.assert_allclose(trained["bias"], true["bias"], atol=0.02)
    assert _meta(result, "train_loss") < 0.01  # about the noise variance, 0.0025
    assert "train_accuracy" not in result.meta


def test_linear_regression_diff_is_one_exact_gradient_step_for_a_full_batch() -> None:
    x, y, _ = _regression_data(n=64)
    rng = np.random.default_rng(7)
    initial = {"weight": rng.normal(size=(5, 1)), "bias": np.array([0.3])}  # float64: exact comparison
    trainer = LinearRegressionTrainer(epochs=1, batch_size=64, learning_rate=0.1)
    result = trainer.execute(_weights(initial), _ctx(ArrayDataSource({"train": (x, y)})), Signal())
    x64, y64 = x.astype(np.float64), y.astype(np.float64)[:, None]
    residual = x64 @ initial["weight"] + initial["bias"] - y64
    grad_w, grad_b = 2 / 64 * x64.T @ residual, 2 / 64 * residual.sum(axis=0)
    np.testing.assert_allclose(result.data["weight"], -0.1 * grad_w, rtol=1e-10)
    np.testing.assert_allclose(result.data["bias"], -0.1 * grad_b, rtol=1e-10)
    assert result.data["weight"].dtype == np.float64
    assert result.meta[MetaKey.NUM_STEPS_CURRENT_ROUND] == 1


@pytest.mark.parametrize(
    ("trainer", "initial", "floor"),
    [
        (SoftmaxRegressionTrainer(epochs=10, batch_size=32, learning_rate=0.2), ("softmax",), 0.92),
        (MLPTrainer(epochs=20, batch_size=32, learning_rate=0.1), ("mlp",), 0.93),
    ],
    ids=["softmax", "mlp"],
)
def test_classifiers_learn_digits_to_a_sensible_test_accuracy(
    digits: Split, digits_source: ArrayDataSource, trainer: Any, initial: tuple[str], floor: float
) -> None:
    x_train, x_test, _, y_test = digits
    start = (
        SoftmaxRegressionTrainer.init_weights(64, 10)
        if initial[0] == "softmax"
        else MLPTrainer.init_weights(64, 32, 10, seed=0)
    )
    recorder = LossRecorder()
    result = trainer.execute(_weights(start), _ctx(digits_source, handlers=[recorder]), Signal())
    losses = [r.loss for r in recorder.records]
    assert len(losses) == trainer.epochs and losses[-1] < losses[0] / 3, losses
    assert result.meta[MetaKey.NUM_EXAMPLES] == len(x_train) and weight_of(result) == len(x_train)
    assert result.meta[MetaKey.NUM_STEPS_CURRENT_ROUND] == trainer.epochs * -(-len(x_train) // 32)
    assert _meta(result, "train_accuracy") > floor
    assert "val_loss" not in result.meta  # the source has no "valid" dataset

    trained = _apply(start, result)
    metrics = trainer.execute(_weights(trained), _ctx(digits_source, "evaluate"), Signal())
    assert metrics.kind == DataKind.METRICS
    assert metrics.meta == {MetaKey.NUM_EXAMPLES: len(x_test), "dataset_type": "test"}
    assert float(metrics.data["accuracy"]) > floor
    predicted = np.argmax(_logits(trained, x_test), axis=1)
    assert float(metrics.data["accuracy"]) == pytest.approx(np.mean(predicted == y_test))


def test_global_plus_diff_is_the_locally_trained_model(digits_source: ArrayDataSource) -> None:
    # train_loss is measured on the trained model; evaluating global + diff on the train set must
    # reproduce it, so the diff carries exactly the trained weights (up to float32 rounding).
    start = MLPTrainer.init_weights(64, 16, 10, seed=4)
    trainer = MLPTrainer(epochs=2, batch_size=64, learning_rate=0.1)
    result = trainer.execute(_weights(start), _ctx(digits_source), Signal())
    assert set(result.data) == {"w1", "b1", "w2", "b2"}
    assert all(result.data[n].dtype == np.float32 for n in result.data)
    task = DXO(kind=DataKind.WEIGHTS, data=_apply(start, result), meta={"dataset_type": "train"})
    metrics = trainer.execute(task, _ctx(digits_source, "evaluate"), Signal())
    assert float(metrics.data["loss"]) == pytest.approx(_meta(result, "train_loss"), rel=1e-5)
    assert float(metrics.data["accuracy"]) == pytest.approx(_meta(result, "train_accuracy"))


def test_fedprox_mu_keeps_the_local_model_closer_to_the_global_one(digits_source: ArrayDataSource) -> None:
    start = SoftmaxRegressionTrainer.init_weights(64, 10)

    def distance(mu: float) -> float:
        trainer = SoftmaxRegressionTrainer(epochs=3, batch_size=32, learning_rate=0.2, mu=mu)
        diff = trainer.execute(_weights(start), _ctx(digits_source), Signal())
        return float(np.sqrt(sum(np.sum(np.square(v)) for v in diff.data.values())))

    plain, prox = distance(0.0), distance(1.0)
    assert prox < 0.8 * plain, (prox, plain)


def test_same_seed_gives_identical_bits_and_other_seeds_or_partitions_differ(
    digits_source: ArrayDataSource,
) -> None:
    start = MLPTrainer.init_weights(64, 8, 10, seed=1)

    def run(seed: int, partition: int = 0) -> bytes:
        trainer = MLPTrainer(epochs=1, batch_size=50, learning_rate=0.05, seed=seed)
        ctx = _ctx(digits_source, partition=partition)
        return trainer.execute(_weights(start), ctx, Signal()).to_bytes()

    assert run(3) == run(3)
    assert run(3) != run(4)
    assert run(3, partition=0) != run(3, partition=1)


def test_validation_metrics_are_reported_when_the_source_has_a_valid_dataset(digits: Split) -> None:
    x_train, x_test, y_train, y_test = digits
    source = ArrayDataSource({"train": (x_train, y_train), "valid": (x_test, y_test)})
    result = SoftmaxRegressionTrainer(epochs=2, learning_rate=0.2).execute(
        _weights(SoftmaxRegressionTrainer.init_weights(64, 10)), _ctx(source), Signal()
    )
    assert 0.5 < _meta(result, "val_accuracy") <= 1.0
    assert _meta(result, "val_loss") > 0


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_the_diff_keeps_the_incoming_dtype(digits_source: ArrayDataSource, dtype: Any) -> None:
    start = SoftmaxRegressionTrainer.init_weights(64, 10, dtype=dtype)
    result = SoftmaxRegressionTrainer(learning_rate=0.1).execute(
        _weights(start), _ctx(digits_source), Signal()
    )
    assert {v.dtype for v in result.data.values()} == {np.dtype(dtype)}
    assert np.any(result.data["weight"] != 0)


class _StopAfterFirstEpoch:
    def __init__(self, signal: Signal) -> None:
        self.signal = signal
        self.epochs: list[int] = []

    def handle_event(self, event_type: str, event_data: Any, ctx: Context) -> None:
        if event_type == EventType.LOSS_GENERATED:
            self.epochs.append(event_data["epoch"])
            self.signal.trigger("test stop")


def test_abort_is_honoured_between_batches(digits_source: ArrayDataSource) -> None:
    signal = Signal()
    stopper = _StopAfterFirstEpoch(signal)
    ctx = _ctx(digits_source, handlers=[stopper])
    with pytest.raises(Aborted, match="test stop"):
        MLPTrainer(epochs=5).execute(_weights(MLPTrainer.init_weights(64, 8, 10)), ctx, signal)
    assert stopper.epochs == [0]


def test_the_data_source_arg_overrides_the_context(digits: Split) -> None:
    x_train, _, y_train, _ = digits
    small = ArrayDataSource({"train": (x_train[:40], y_train[:40])})
    trainer = SoftmaxRegressionTrainer(data_source=small)
    result = trainer.execute(_weights(SoftmaxRegressionTrainer.init_weights(64, 10)), Context(), Signal())
    assert result.meta[MetaKey.NUM_EXAMPLES] == 40


@pytest.mark.parametrize("context", [Context(), Context({ContextKey.DATA_SOURCE: None})])
def test_a_device_without_data_is_told_where_data_comes_from(context: Context) -> None:
    # A runner or virtual device started without --data sets no source (or None): the trainer says so.
    trainer = SoftmaxRegressionTrainer()
    with pytest.raises(FailedPrecondition, match=r"no data to train or evaluate on: give the runner --data"):
        trainer.execute(_weights(SoftmaxRegressionTrainer.init_weights(64, 10)), context, Signal())


def test_bad_inputs_are_clear_errors(digits_source: ArrayDataSource) -> None:
    trainer = SoftmaxRegressionTrainer()
    good = SoftmaxRegressionTrainer.init_weights(64, 10)
    with pytest.raises(InvalidArgument, match="needs a WEIGHTS DXO"):
        trainer.execute(DXO(kind=DataKind.WEIGHT_DIFF, data=good), _ctx(digits_source), Signal())
    with pytest.raises(InvalidArgument, match=r"lacks variable\(s\) \['bias'\]"):
        trainer.execute(_weights({"weight": good["weight"]}), _ctx(digits_source), Signal())
    with pytest.raises(InvalidArgument, match="64 features per sample; the model expects 10"):
        trainer.execute(
            _weights(SoftmaxRegressionTrainer.init_weights(10, 10)), _ctx(digits_source), Signal()
        )
    with pytest.raises(InvalidArgument, match=r"labels range over \[0, 9\]; the model has 5 classes"):
        trainer.execute(_weights(SoftmaxRegressionTrainer.init_weights(64, 5)), _ctx(digits_source), Signal())
    with pytest.raises(FailedPrecondition, match="no data to train or evaluate on"):
        trainer.execute(_weights(good), Context({ContextKey.TASK_NAME: "train"}), Signal())
    no_eval = ArrayDataSource({"train": (np.zeros((2, 64)), np.zeros(2, dtype=int))})
    with pytest.raises(FailedPrecondition, match=r"no non-empty dataset among \['valid', 'test'\]"):
        trainer.execute(_weights(good), _ctx(no_eval, "evaluate"), Signal())


def test_divergence_is_reported_instead_of_sending_nan() -> None:
    x, y, _ = _regression_data(n=64)
    trainer = LinearRegressionTrainer(epochs=3, batch_size=8, learning_rate=1e6)
    with pytest.raises(InvalidArgument, match="training diverged"):
        trainer.execute(
            _weights(LinearRegressionTrainer.init_weights(5, 1)),
            _ctx(ArrayDataSource({"train": (x, y)})),
            Signal(),
        )


@pytest.mark.parametrize(
    ("arg", "value"), [("epochs", 0), ("batch_size", 1.5), ("learning_rate", 0), ("mu", -1), ("seed", -1)]
)
def test_constructor_args_are_validated(arg: str, value: Any) -> None:
    with pytest.raises(InvalidArgument, match=arg):
        MLPTrainer(**{arg: value})
