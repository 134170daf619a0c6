"""``time_scale``: the coordinator's timeouts and the devices' simulated compute times run on one scaled
clock, so simulated minutes take real seconds and a round times out at its simulated deadline."""

from __future__ import annotations

import numpy as np
import pytest

from fedlink.common.errors import InvalidArgument
from fedlink.server.workflows.fedbuff import FedBuffParams
from fedlink.simulation import Heterogeneity, SimulationJob, run_simulation

from .conftest import AddPartition, job_with

SCALE = 100.0
#: Simulated seconds a loaded machine may add to a round (its own work: 0.6 s of real time at SCALE).
SLACK_S = 60.0


def test_simulated_compute_time_passes_scale_times_faster_on_the_coordinator_s_clock_too() -> None:
    hetero = Heterogeneity(compute_time_s=(100.0, 0.0))  # every task: 100 simulated seconds
    job = job_with(num_rounds=2, round_timeout_s=600.0)
    result = run_simulation(job, 3, runner=AddPartition(), heterogeneity=hetero, time_scale=SCALE)
    assert [r.num_results for r in result.rounds] == [3, 3]
    # The store's round times are simulated seconds: each round took its devices' 100 s (once: not 200)...
    assert all(100.0 <= r.duration_s < 100.0 + SLACK_S for r in result.rounds), result.rounds
    first, second = (r.virtual_time_s for r in result.rounds)
    assert 100.0 <= first < second and second >= 200.0
    assert result.wall_time_s < 20.0  # ...in a fraction of 200 real seconds


def _seed_with_two_fast_and_two_slow(hetero: Heterogeneity) -> int:
    for seed in range(1000):
        times = [hetero.draw(seed, d, 1).compute_s or 0.0 for d in range(4)]
        if sum(t < 10.0 for t in times) == 2 and sum(t > 600.0 for t in times) == 2:
            return seed
    raise AssertionError("no seed gives two fast and two slow devices")


def test_a_round_times_out_at_its_simulated_deadline_with_the_fast_devices_results() -> None:
    # Two devices finish in under 10 simulated seconds, two take over 10 simulated minutes: the round
    # must close at its 30 s simulated timeout. On real time it would take 30 real seconds.
    hetero = Heterogeneity(compute_time_s=(30.0, 3.0))
    seed = _seed_with_two_fast_and_two_slow(hetero)
    job = job_with(num_rounds=1, devices_per_round=4, min_results=2, round_timeout_s=30.0)
    result = run_simulation(job, 4, runner=AddPartition(), heterogeneity=hetero, seed=seed, time_scale=SCALE)
    (only,) = result.rounds
    assert only.num_results == 2
    assert 30.0 <= only.duration_s < 30.0 + SLACK_S, only  # not at the slow devices' 600 s
    assert result.wall_time_s < 15.0


@pytest.mark.parametrize("scale", [0.5, 0, float("inf"), True])
def test_a_bad_time_scale_is_refused(scale: float) -> None:
    with pytest.raises(InvalidArgument, match="time_scale must be a number >= 1"):
        run_simulation(job_with(), 2, runner=AddPartition(), time_scale=scale)


def test_fedbuff_refills_the_slots_of_devices_that_went_away_when_their_task_times_out() -> None:
    # 3 of 10 devices go away with their task; FedBuff's 60 s (simulated) task timeout frees the slot
    # for a device that is still there. On real time the run would take minutes.
    hetero = Heterogeneity(compute_time_s=(5.0, 0.5), vanish=0.3)
    params = FedBuffParams(
        max_model_version=6,
        device_selection_size=4,
        num_updates_for_model=2,
        max_model_history=0,
        task_timeout_s=60.0,
        pickup_timeout_s=30.0,
        seed=4,
    )
    job = SimulationJob(name="gone", workflow=params, model={"w": np.zeros(3, np.float32)})
    result = run_simulation(job, 10, runner=AddPartition(), heterogeneity=hetero, seed=4, time_scale=SCALE)
    assert result.vanished, "the seed gives no device that goes away"
    assert all(hetero.draw(4, d, r).vanished for d, r in result.vanished)
    assert len(result.rounds) == 6 and all(r.num_results >= 2 for r in result.rounds)
    # a device that went away took no task after it: it went away once
    assert len({d for d, _ in result.vanished}) == len(result.vanished)
    assert result.rounds[-1].virtual_time_s >= 60.0  # at least one slot waited out its task timeout
    assert result.wall_time_s < 30.0


def test_fedavg_closes_the_round_at_its_timeout_when_devices_went_away() -> None:
    hetero = Heterogeneity(compute_time_s=(2.0, 0.0), vanish=0.3)
    job = job_with(num_rounds=1, devices_per_round=8, min_results=2, round_timeout_s=40.0)
    result = run_simulation(job, 8, runner=AddPartition(), heterogeneity=hetero, seed=1, time_scale=SCALE)
    gone = [hetero.draw(1, d, 1).vanished for d in range(8)]
    assert any(gone) and not all(gone)
    (only,) = result.rounds
    assert only.num_results == 8 - sum(gone)
    # waited for the missing ones until the (simulated) timeout, and no longer
    assert 40.0 <= only.duration_s < 40.0 + SLACK_S, only
