"""The shared training loop of the built-in numpy trainers: mini-batch SGD, FedProx, evaluation."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from fedlink.common.dxo import DXO, DataKind, MetaKey, MetaValue
from fedlink.common.errors import FailedPrecondition, InvalidArgument, NotFound
from fedlink.runner.context import Context, ContextKey, EventType, Signal
from fedlink.runner.spec import DataSource

__all__ = ["DEFAULT_EVALUATE_TASKS", "Arrays", "NumpyTrainer"]

Arrays = dict[str, npt.NDArray[np.floating[Any]]]
DEFAULT_EVALUATE_TASKS: tuple[str, ...] = ("evaluate", "validate")


class NumpyTrainer(ABC):
    """Mini-batch SGD on a numpy model; subclasses define the model (its variables, loss and gradient).

    **Train** (any task name not in ``evaluate_tasks``): takes the global model from the task's
    ``WEIGHTS`` DXO, runs ``epochs`` epochs of SGD over the data source's ``"train"`` dataset in
    mini-batches of ``batch_size`` (the last one may be smaller), shuffled by a generator seeded with
    ``(seed, partition id, meta model_version)`` so equal inputs give equal bits, and returns a
    ``WEIGHT_DIFF`` DXO (trained minus global, in each variable's incoming dtype) with meta
    ``num_examples``, ``num_steps_current_round``, ``train_loss`` (and ``train_accuracy`` for
    classifiers) of the trained model on the whole training set, plus ``val_loss``/``val_accuracy``
    when the source has a ``"valid"`` dataset. With ``mu > 0`` it adds FedProx's proximal term
    ``mu/2 * ||w - w_global||²`` to the loss (gradient ``mu * (w - w_global)``). A
    ``LOSS_GENERATED`` event (``{"loss": epoch mean batch loss, "epoch", "iter": steps so far}``) is
    fired after every epoch, and the abort signal is checked before every batch.

    **Evaluate** (task names in ``evaluate_tasks``): no training; returns a ``METRICS`` DXO whose data
    holds 0-d float64 arrays ``loss`` (and ``accuracy``) of the task's model on the first dataset of
    ``eval_datasets`` the source has (or the one named by the task's meta ``dataset_type``), with
    meta ``num_examples`` and ``dataset_type``.

    Arithmetic runs in float32 for float16/float32 models and in float64 for float64 models; inputs
    are flattened to ``(samples, features)`` and cast to that dtype (no normalisation is applied).
    The data source is the ``data_source`` arg if given, else the context's ``DATA_SOURCE``.
    """

    VARIABLES: ClassVar[tuple[str, ...]]
    """The variable names of the model, in the task's ``WEIGHTS`` DXO and the result's diff."""
    CLASSIFIER: ClassVar[bool]
    """Whether labels are class indices (accuracy is reported) or real-valued targets."""

    def __init__(
        self,
        epochs: int = 1,
        batch_size: int = 32,
        learning_rate: float = 0.01,
        mu: float = 0.0,
        seed: int = 0,
        data_source: DataSource | None = None,
        evaluate_tasks: Sequence[str] = DEFAULT_EVALUATE_TASKS,
        eval_datasets: Sequence[str] = ("valid", "test"),
    ) -> None:
        """Configure the trainer (the job config's ``args``).

        Raises:
            InvalidArgument: A value out of range (the message names the arg).
        """
        self.epochs = _positive_int("epochs", epochs)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.learning_rate = _number("learning_rate", learning_rate, minimum=0.0, inclusive=False)
        self.mu = _number("mu", mu, minimum=0.0, inclusive=True)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InvalidArgument(f"seed must be an integer >= 0, got {seed!r}")
        self.seed = seed
        self.data_source = data_source
        self.evaluate_tasks = frozenset(evaluate_tasks)
        self.eval_datasets = tuple(eval_datasets)

    # -- what a model defines ------------------------------------------------------------------

    @abstractmethod
    def _check_model(self, params: Arrays) -> None:
        """Raise InvalidArgument if the variables' shapes do not fit together."""

    @abstractmethod
    def _num_inputs(self, params: Arrays) -> int:
        """The number of input features the model expects."""

    @abstractmethod
    def _num_outputs(self, params: Arrays) -> int:
        """The number of classes (classifiers) or regression targets."""

    @abstractmethod
    def _outputs(self, params: Arrays, x: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Predictions (regression) or logits (classifiers) for ``x``."""

    @abstractmethod
    def _loss_and_grads(
        self, params: Arrays, x: npt.NDArray[Any], y: npt.NDArray[Any]
    ) -> tuple[float, Arrays]:
        """The mean loss over the batch and its gradient for every variable (fresh arrays)."""

    # -- the executor ---------------------------------------------------------------------------

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """Train on, or evaluate, the task's model depending on the task name (see the class doc)."""
        task_name = str(ctx.get(ContextKey.TASK_NAME, "train"))
        if task_name in self.evaluate_tasks:
            return self.evaluate(dxo, ctx, abort_signal)
        return self.train(dxo, ctx, abort_signal)

    def train(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """Train the task's global model locally and return the ``WEIGHT_DIFF`` (see the class doc)."""
        incoming, dtype = self._read_model(dxo)
        global_params = {name: value.astype(dtype) for name, value in incoming.items()}
        params = {name: value.copy() for name, value in global_params.items()}
        source = self._source(ctx)
        x, y = self._load(source, "train", ctx, params, dtype)
        n = len(x)
        if n == 0:
            raise FailedPrecondition("the 'train' dataset is empty; there is nothing to train on")
        rng = np.random.default_rng([self.seed, _partition_id(ctx), _model_version(dxo)])
        steps = 0
        for epoch in range(self.epochs):
            order = rng.permutation(n)
            total = 0.0
            for start in range(0, n, self.batch_size):
                abort_signal.check()
                batch = order[start : start + self.batch_size]
                # A diverging run overflows; it is reported below as an error, not as warnings.
                with np.errstate(over="ignore", invalid="ignore"):
                    loss, grads = self._loss_and_grads(params, x[batch], y[batch])
                if not math.isfinite(loss):
                    raise InvalidArgument(
                        f"training diverged (loss {loss} at step {steps} of epoch {epoch}); lower "
                        f"learning_rate (now {self.learning_rate}) or scale the inputs"
                    )
                for name, grad in grads.items():
                    if self.mu > 0.0:
                        grad += dtype.type(self.mu) * (params[name] - global_params[name])
                    params[name] -= dtype.type(self.learning_rate) * grad
                total += loss * len(batch)
                steps += 1
            event = {"loss": total / n, "epoch": epoch, "iter": steps}
            ctx.fire_event(EventType.LOSS_GENERATED, event)

        meta: dict[str, MetaValue] = {MetaKey.NUM_EXAMPLES: n, MetaKey.NUM_STEPS_CURRENT_ROUND: steps}
        meta.update(self._metrics(params, x, y, "train_"))
        try:
            x_val, y_val = self._load(source, "valid", ctx, params, dtype)
        except NotFound:
            pass
        else:
            if len(x_val):
                meta.update(self._metrics(params, x_val, y_val, "val_"))
        diff = {name: (params[name] - global_params[name]).astype(incoming[name].dtype) for name in params}
        return DXO(kind=DataKind.WEIGHT_DIFF, data=diff, meta=meta)

    def evaluate(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """Evaluate the task's model without training; return a ``METRICS`` DXO (see the class doc)."""
        abort_signal.check()
        incoming, dtype = self._read_model(dxo)
        params = {name: value.astype(dtype) for name, value in incoming.items()}
        source = self._source(ctx)
        requested = dxo.get_meta_prop("dataset_type")
        candidates = (str(requested),) if isinstance(requested, str) else self.eval_datasets
        for dataset_type in candidates:
            try:
                x, y = self._load(source, dataset_type, ctx, params, dtype)
            except NotFound:
                continue
            if len(x) == 0:
                continue
            metrics = self._metrics(params, x, y, "")
            data = {key: np.asarray(value, dtype=np.float64) for key, value in metrics.items()}
            meta: dict[str, MetaValue] = {MetaKey.NUM_EXAMPLES: len(x), "dataset_type": dataset_type}
            return DXO(kind=DataKind.METRICS, data=data, meta=meta)
        raise FailedPrecondition(f"the data source has no non-empty dataset among {list(candidates)}")

    # -- helpers --------------------------------------------------------------------------------

    def _read_model(self, dxo: DXO) -> tuple[dict[str, npt.NDArray[Any]], np.dtype[Any]]:
        name = type(self).__name__
        if dxo.kind != DataKind.WEIGHTS:
            raise InvalidArgument(f"{name} needs a WEIGHTS DXO with the global model, got {dxo.kind}")
        missing = [v for v in self.VARIABLES if v not in dxo.data]
        if missing:
            raise InvalidArgument(
                f"{name}: the model lacks variable(s) {missing}; expected {list(self.VARIABLES)}"
            )
        incoming = {v: dxo.data[v] for v in self.VARIABLES}
        for var, value in incoming.items():
            if value.dtype.kind != "f":
                raise InvalidArgument(f"{name}: variable {var!r} must be a float array, not {value.dtype}")
        # float16 models are trained in float32: SGD steps vanish in float16's precision.
        dtype = np.result_type(np.float32, *(value.dtype for value in incoming.values()))
        self._check_model(incoming)
        return incoming, dtype

    def _source(self, ctx: Context) -> DataSource:
        if self.data_source is not None:
            return self.data_source
        source: DataSource = ctx.data_source()
        return source

    def _load(
        self, source: DataSource, dataset_type: str, ctx: Context, params: Arrays, dtype: np.dtype[Any]
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        x_raw, y_raw = source.get_dataset(dataset_type, ctx).arrays()
        x = np.asarray(x_raw).reshape(len(x_raw), -1).astype(dtype, copy=False)
        features = self._num_inputs(params)
        if x.shape[1] != features:
            raise InvalidArgument(
                f"the {dataset_type!r} dataset has {x.shape[1]} features per sample; "
                f"the model expects {features}"
            )
        outputs = self._num_outputs(params)
        y = np.asarray(y_raw)
        if self.CLASSIFIER:
            return x, _class_labels(y, outputs, dataset_type)
        y = y.reshape(len(y), -1).astype(dtype, copy=False)
        if y.shape[1] != outputs:
            raise InvalidArgument(
                f"the {dataset_type!r} dataset has {y.shape[1]} targets per sample; the model has {outputs}"
            )
        return x, y

    def _metrics(
        self, params: Arrays, x: npt.NDArray[Any], y: npt.NDArray[Any], prefix: str
    ) -> dict[str, float]:
        outputs = self._outputs(params, x)
        if not self.CLASSIFIER:
            return {f"{prefix}loss": float(np.mean(np.square(outputs - y), dtype=np.float64))}
        log_probs = _log_softmax(outputs)
        loss = -float(np.mean(log_probs[np.arange(len(y)), y], dtype=np.float64))
        accuracy = float(np.mean(np.argmax(outputs, axis=1) == y))
        return {f"{prefix}loss": loss, f"{prefix}accuracy": accuracy}


def _log_softmax(logits: npt.NDArray[Any]) -> npt.NDArray[Any]:
    shifted = logits - logits.max(axis=1, keepdims=True)
    result: npt.NDArray[Any] = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return result


def softmax_cross_entropy(
    logits: npt.NDArray[Any], y: npt.NDArray[np.int64]
) -> tuple[float, npt.NDArray[Any]]:
    """Mean cross-entropy of integer labels ``y`` and its gradient with respect to ``logits``."""
    log_probs = _log_softmax(logits)
    n = len(y)
    loss = -float(np.mean(log_probs[np.arange(n), y], dtype=np.float64))
    grad = np.exp(log_probs)
    grad[np.arange(n), y] -= 1
    grad /= n
    return loss, grad


def _class_labels(y: npt.NDArray[Any], num_classes: int, dataset_type: str) -> npt.NDArray[np.int64]:
    labels = y.reshape(-1)
    if len(labels) != len(y):
        raise InvalidArgument(f"the {dataset_type!r} labels must be one class index per sample")
    if labels.dtype.kind == "f" and np.all(np.isfinite(labels)) and np.all(labels == np.round(labels)):
        labels = labels.astype(np.int64)
    if labels.dtype.kind not in "iu":
        raise InvalidArgument(f"the {dataset_type!r} labels must be integer class indices, not {y.dtype}")
    labels = labels.astype(np.int64, copy=False)
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise InvalidArgument(
            f"the {dataset_type!r} labels range over [{labels.min()}, {labels.max()}]; "
            f"the model has {num_classes} classes"
        )
    return labels


def _partition_id(ctx: Context) -> int:
    value = ctx.get(ContextKey.PARTITION_ID, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _model_version(dxo: DXO) -> int:
    value = dxo.get_meta_prop(MetaKey.MODEL_VERSION, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _positive_int(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _number(name: str, value: float, *, minimum: float, inclusive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number, got {value!r}")
    if value < minimum or (value == minimum and not inclusive):
        bound = ">=" if inclusive else ">"
        raise InvalidArgument(f"{name} must be {bound} {minimum}, got {value!r}")
    return float(value)
