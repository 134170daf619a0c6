"""The async-vs-sync study (``examples/fedbuff_study/study.py``), tiny: a few devices, a few models each.

Both curves must come from models the runs made and kept (the store's checkpoints, evaluated on the
held-out digits), learn well above chance, and be what the seed makes. No timing is asserted: the
scaled clock's minutes are the study's output, not a property of the code.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from examples.fedbuff_study import study

#: Chance on ten balanced classes; the zeros model predicts class 0 for everything, about this.
CHANCE = 0.1

TINY = study.StudyConfig(
    devices=4,
    median_compute_s=5.0,
    task_sigma=0.5,
    speed_sigma=0.4,
    dropout=0.0,
    rounds=3,
    devices_per_round=4,
    min_results=4,  # every device every round: the rounds' models do not depend on arrival order
    round_timeout_s=600.0,
    versions=6,
    selection=3,
    updates_per_version=2,
    max_model_history=4,
    task_timeout_s=600.0,
    target=0.6,
)


@pytest.fixture(scope="module")
def arms() -> list[study.Arm]:
    return study.run_study(TINY, baseline=False, log=False)


def test_both_curves_hold_every_model_the_runs_made_evaluated_on_the_held_out_split(
    arms: list[study.Arm],
) -> None:
    by_name = {a.name: a for a in arms}
    assert set(by_name) == {"fedavg-delays", "fedbuff-delays"}
    fedavg, fedbuff = by_name["fedavg-delays"].curve, by_name["fedbuff-delays"].curve
    assert fedavg.steps == (0, 1, 2, 3)  # the initial model, then every round's
    assert fedbuff.steps == (0, 1, 2, 3, 4, 5, 6)  # the initial model, then every version's
    for curve in (fedavg, fedbuff):
        assert len(curve.times_s) == len(curve.accuracies) == len(curve.steps)
        assert curve.times_s[0] == 0.0
        assert all(a < b for a, b in zip(curve.times_s, curve.times_s[1:], strict=False)), curve.times_s
        # the initial zeros model is at chance; the models after it are evaluated, not copied
        assert curve.accuracies[0] == pytest.approx(CHANCE, abs=0.02)
        assert len(set(curve.accuracies)) > 2, curve.accuracies
    # the last checkpoint is the run's final model
    for arm in arms:
        assert arm.curve.final_accuracy == arm.final_model_accuracy


def test_both_workflows_learn_well_above_chance_and_fedbuff_aggregates_k_updates_per_version(
    arms: list[study.Arm],
) -> None:
    for arm in arms:
        assert arm.curve.final_accuracy > 0.6, (arm.name, arm.curve.accuracies)
        assert max(arm.curve.accuracies[1:]) > arm.curve.accuracies[0] + 0.4
        assert arm.curve.time_to(0.6) is not None
    fedavg, fedbuff = arms
    assert fedavg.updates == TINY.rounds * TINY.devices_per_round
    assert fedbuff.updates >= TINY.versions * TINY.updates_per_version
    assert fedbuff.extra["mean_staleness"] >= 0.0


def test_the_same_seed_gives_the_same_fedavg_models_and_another_seed_other_ones(
    arms: list[study.Arm],
) -> None:
    # FedAvg waits for every device here, so its models are the seed's whatever the arrival order;
    # FedBuff's versions mix whichever updates arrive first, so only its shape is asserted above.
    digits = study.Digits(TINY.seed)
    again = study.run_study(TINY, baseline=False, log=False)
    assert again[0].curve.accuracies == arms[0].curve.accuracies
    assert again[0].curve.steps == arms[0].curve.steps
    other = dataclasses.replace(TINY, seed=1)
    changed = study.run_study(other, baseline=False, log=False)
    assert changed[0].curve.accuracies != arms[0].curve.accuracies
    # the seed's split: the same held-out digits for the same seed, others for another
    assert np.array_equal(study.Digits(TINY.seed).y_test, digits.y_test)
    assert not np.array_equal(study.Digits(1).y_test, digits.y_test)


def test_the_table_and_the_plot_show_both_runs(arms: list[study.Arm], tmp_path: Path) -> None:
    text = study.table(TINY, arms)
    assert "fedavg-delays" in text and "fedbuff-delays" in text
    path = tmp_path / "plot.png"
    study.draw(TINY, arms, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = study.summary(TINY, arms)
    assert summary["arms"]["fedbuff-delays"]["accuracies"] == list(arms[1].curve.accuracies)


def test_a_curve_times_its_first_crossing_and_when_it_held_the_target_for_good() -> None:
    curve = study.Curve(
        steps=(0, 1, 2, 3, 4),
        times_s=(0.0, 60.0, 120.0, 180.0, 240.0),
        accuracies=(0.1, 0.86, 0.7, 0.9, 0.88),
    )
    assert curve.time_to(0.85) == 60.0  # touched at 1 minute...
    assert curve.time_held(0.85) == 180.0  # ...kept from 3 minutes
    assert curve.time_to(0.95) is None and curve.time_held(0.95) is None
    assert curve.time_held(0.89) is None  # the last model fell below it again
