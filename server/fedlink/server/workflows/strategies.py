"""The server-optimizer strategies' parameters: FedAvg's rounds plus each optimizer's own knobs.

Each is a FedAvg job whose server step is not a plain addition (:mod:`fedlink.server.workflows.optimizers`);
the defaults are Flower 1.42's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fedlink.common.errors import InvalidArgument
from fedlink.server.workflows.fedavg import FedAvgParams
from fedlink.server.workflows.optimizers import AdaptiveStep, MomentumStep, ServerStep


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise InvalidArgument(f"{name} must be in [0, 1), not {value}")


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise InvalidArgument(f"{name} must be a positive number, not {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class FedAvgMParams(FedAvgParams):
    """FedAvgM's parameters: FedAvg's rounds, a server learning rate and momentum (Flower's defaults)."""

    server_learning_rate: float = 1.0
    server_momentum: float = 0.0

    def __post_init__(self) -> None:
        FedAvgParams.__post_init__(self)
        _check_positive("server_learning_rate", self.server_learning_rate)
        _check_unit("server_momentum", self.server_momentum)

    def server_step(self) -> ServerStep:
        """The step these parameters make."""
        return MomentumStep(learning_rate=self.server_learning_rate, momentum=self.server_momentum)


@dataclass(frozen=True, slots=True, kw_only=True)
class FedAdamParams(FedAvgParams):
    """FedAdam's parameters (Flower 1.42's defaults)."""

    server_learning_rate: float = 0.1
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3
    bias_correction: bool = True

    def __post_init__(self) -> None:
        FedAvgParams.__post_init__(self)
        _check_positive("server_learning_rate", self.server_learning_rate)
        _check_unit("beta_1", self.beta_1)
        _check_unit("beta_2", self.beta_2)
        _check_positive("tau", self.tau)

    def server_step(self) -> ServerStep:
        """The step these parameters make."""
        return AdaptiveStep(
            rule="adam",
            learning_rate=self.server_learning_rate,
            beta_1=self.beta_1,
            beta_2=self.beta_2,
            tau=self.tau,
            bias_correction=self.bias_correction,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class FedYogiParams(FedAvgParams):
    """FedYogi's parameters (Flower 1.42's defaults)."""

    server_learning_rate: float = 0.01
    beta_1: float = 0.9
    beta_2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self) -> None:
        FedAvgParams.__post_init__(self)
        _check_positive("server_learning_rate", self.server_learning_rate)
        _check_unit("beta_1", self.beta_1)
        _check_unit("beta_2", self.beta_2)
        _check_positive("tau", self.tau)

    def server_step(self) -> ServerStep:
        """The step these parameters make."""
        return AdaptiveStep(
            rule="yogi",
            learning_rate=self.server_learning_rate,
            beta_1=self.beta_1,
            beta_2=self.beta_2,
            tau=self.tau,
            bias_correction=False,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class FedAdagradParams(FedAvgParams):
    """FedAdagrad's parameters (Flower 1.42's defaults)."""

    server_learning_rate: float = 0.1
    tau: float = 1e-3

    def __post_init__(self) -> None:
        FedAvgParams.__post_init__(self)
        _check_positive("server_learning_rate", self.server_learning_rate)
        _check_positive("tau", self.tau)

    def server_step(self) -> ServerStep:
        """The step these parameters make."""
        return AdaptiveStep(rule="adagrad", learning_rate=self.server_learning_rate, tau=self.tau)
