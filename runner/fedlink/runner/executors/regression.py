"""Linear regression (mean squared error) and softmax regression (multinomial logistic) trainers."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from fedlink.common.errors import InvalidArgument
from fedlink.runner.executors.base import Arrays, NumpyTrainer, softmax_cross_entropy

__all__ = ["LinearRegressionTrainer", "SoftmaxRegressionTrainer"]


class _AffineModel(NumpyTrainer):
    """``outputs = x @ weight + bias`` with ``weight`` of shape (features, outputs), ``bias`` (outputs,)."""

    VARIABLES: ClassVar[tuple[str, ...]] = ("weight", "bias")

    @classmethod
    def init_weights(
        cls, num_features: int, num_outputs: int, *, dtype: npt.DTypeLike = np.float32
    ) -> dict[str, npt.NDArray[Any]]:
        """A zero model (a fine start for a convex loss): ``weight`` (features, outputs), ``bias``."""
        return {
            "weight": np.zeros((num_features, num_outputs), dtype=dtype),
            "bias": np.zeros((num_outputs,), dtype=dtype),
        }

    def _check_model(self, params: Arrays) -> None:
        weight, bias = params["weight"], params["bias"]
        if weight.ndim != 2 or bias.shape != (weight.shape[1],):
            raise InvalidArgument(
                f"{type(self).__name__}: 'weight' must be (features, outputs) and 'bias' (outputs,); "
                f"got {weight.shape} and {bias.shape}"
            )

    def _num_inputs(self, params: Arrays) -> int:
        return int(params["weight"].shape[0])

    def _num_outputs(self, params: Arrays) -> int:
        return int(params["weight"].shape[1])

    def _outputs(self, params: Arrays, x: npt.NDArray[Any]) -> npt.NDArray[Any]:
        result: npt.NDArray[Any] = x @ params["weight"] + params["bias"]
        return result


class LinearRegressionTrainer(_AffineModel):
    """Linear regression by mini-batch SGD on the mean squared error (over samples and targets).

    Model variables: ``weight`` (features, targets) and ``bias`` (targets,). Labels: real-valued,
    shape (samples,) for one target or (samples, targets). Reports ``*_loss`` (MSE) only. The training
    loop, args, result and evaluation are those of :class:`~fedlink.runner.executors.base.NumpyTrainer`.
    """

    CLASSIFIER: ClassVar[bool] = False

    def _loss_and_grads(
        self, params: Arrays, x: npt.NDArray[Any], y: npt.NDArray[Any]
    ) -> tuple[float, Arrays]:
        residual = self._outputs(params, x) - y
        loss = float(np.mean(np.square(residual), dtype=np.float64))
        grad_out = residual * residual.dtype.type(2.0 / residual.size)
        return loss, {"weight": x.T @ grad_out, "bias": grad_out.sum(axis=0)}


class SoftmaxRegressionTrainer(_AffineModel):
    """Multinomial logistic regression by mini-batch SGD on the mean cross-entropy.

    Model variables: ``weight`` (features, classes) and ``bias`` (classes,). Labels: integer class
    indices in ``[0, classes)``. Reports ``*_loss`` (cross-entropy) and ``*_accuracy``. The training
    loop, args, result and evaluation are those of :class:`~fedlink.runner.executors.base.NumpyTrainer`.
    """

    CLASSIFIER: ClassVar[bool] = True

    def _loss_and_grads(
        self, params: Arrays, x: npt.NDArray[Any], y: npt.NDArray[Any]
    ) -> tuple[float, Arrays]:
        loss, grad_logits = softmax_cross_entropy(self._outputs(params, x), y)
        return loss, {"weight": x.T @ grad_logits, "bias": grad_logits.sum(axis=0)}
