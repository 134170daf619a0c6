"""A one-hidden-layer perceptron (ReLU, softmax output) trainer."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from fedlink.common.errors import InvalidArgument
from fedlink.runner.executors.base import Arrays, NumpyTrainer, softmax_cross_entropy

__all__ = ["MLPTrainer"]


class MLPTrainer(NumpyTrainer):
    """A classifier ``softmax(relu(x @ w1 + b1) @ w2 + b2)`` trained by mini-batch SGD on cross-entropy.

    Model variables: ``w1`` (features, hidden), ``b1`` (hidden,), ``w2`` (hidden, classes), ``b2``
    (classes,); the hidden width is whatever the global model has. Labels: integer class indices.
    Reports ``*_loss`` and ``*_accuracy``. The training loop, args, result and evaluation are those of
    :class:`~fedlink.runner.executors.base.NumpyTrainer`.
    """

    VARIABLES: ClassVar[tuple[str, ...]] = ("w1", "b1", "w2", "b2")
    CLASSIFIER: ClassVar[bool] = True

    @classmethod
    def init_weights(
        cls,
        num_features: int,
        num_hidden: int,
        num_classes: int,
        *,
        seed: int = 0,
        dtype: npt.DTypeLike = np.float32,
    ) -> dict[str, npt.NDArray[Any]]:
        """A seeded random start: He-normal ``w1`` (suits ReLU), Glorot-normal ``w2``, zero biases."""
        rng = np.random.default_rng(seed)
        w1 = rng.normal(0.0, np.sqrt(2.0 / num_features), (num_features, num_hidden))
        w2 = rng.normal(0.0, np.sqrt(2.0 / (num_hidden + num_classes)), (num_hidden, num_classes))
        return {
            "w1": w1.astype(dtype),
            "b1": np.zeros((num_hidden,), dtype=dtype),
            "w2": w2.astype(dtype),
            "b2": np.zeros((num_classes,), dtype=dtype),
        }

    def _check_model(self, params: Arrays) -> None:
        w1, b1, w2, b2 = (params[name] for name in self.VARIABLES)
        if (
            w1.ndim != 2
            or w2.ndim != 2
            or b1.shape != (w1.shape[1],)
            or w2.shape[0] != w1.shape[1]
            or b2.shape != (w2.shape[1],)
        ):
            raise InvalidArgument(
                "MLPTrainer: expected w1 (features, hidden), b1 (hidden,), w2 (hidden, classes), "
                f"b2 (classes,); got {w1.shape}, {b1.shape}, {w2.shape}, {b2.shape}"
            )

    def _num_inputs(self, params: Arrays) -> int:
        return int(params["w1"].shape[0])

    def _num_outputs(self, params: Arrays) -> int:
        return int(params["w2"].shape[1])

    def _outputs(self, params: Arrays, x: npt.NDArray[Any]) -> npt.NDArray[Any]:
        hidden = np.maximum(x @ params["w1"] + params["b1"], 0)
        result: npt.NDArray[Any] = hidden @ params["w2"] + params["b2"]
        return result

    def _loss_and_grads(
        self, params: Arrays, x: npt.NDArray[Any], y: npt.NDArray[Any]
    ) -> tuple[float, Arrays]:
        pre = x @ params["w1"] + params["b1"]
        hidden = np.maximum(pre, 0)
        loss, grad_logits = softmax_cross_entropy(hidden @ params["w2"] + params["b2"], y)
        grad_hidden = grad_logits @ params["w2"].T
        grad_hidden[pre <= 0] = 0
        return loss, {
            "w1": x.T @ grad_hidden,
            "b1": grad_hidden.sum(axis=0),
            "w2": hidden.T @ grad_logits,
            "b2": grad_logits.sum(axis=0),
        }
