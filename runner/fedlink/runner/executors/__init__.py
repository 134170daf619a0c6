"""Built-in numpy trainers: linear regression, softmax regression and a one-hidden-layer MLP."""

from fedlink.runner.executors.base import NumpyTrainer
from fedlink.runner.executors.mlp import MLPTrainer
from fedlink.runner.executors.regression import LinearRegressionTrainer, SoftmaxRegressionTrainer

__all__ = ["LinearRegressionTrainer", "MLPTrainer", "NumpyTrainer", "SoftmaxRegressionTrainer"]
