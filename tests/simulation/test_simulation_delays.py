"""Log-normal compute times and per-device speed factors: seeded, reproducible, and waited out."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedlink.common.errors import InvalidArgument
from fedlink.server.cli.jobfile import SimulationSection
from fedlink.simulation import Heterogeneity, SimulationJob, run_simulation

from .conftest import AddPartition, job_with


def test_same_seed_gives_the_same_compute_times_and_speeds() -> None:
    hetero = Heterogeneity(compute_time_s=(2.0, 1.0), speed_sigma=0.5, dropout=0.2)
    first = [hetero.draw(7, d, r) for d in range(20) for r in (1, 2, 3)]
    again = [
        Heterogeneity(compute_time_s=(2.0, 1.0), speed_sigma=0.5, dropout=0.2).draw(7, d, r)
        for d in range(20)
        for r in (1, 2, 3)
    ]
    other = [hetero.draw(8, d, r) for d in range(20) for r in (1, 2, 3)]
    assert first == again
    assert [d.compute_s for d in first] != [d.compute_s for d in other]
    assert [hetero.speed(7, d) for d in range(20)] == [hetero.speed(7, d) for d in range(20)]


def test_compute_times_are_log_normal_around_the_median_with_a_heavy_tail() -> None:
    hetero = Heterogeneity(compute_time_s=(2.0, 1.0))
    times = [hetero.draw(0, d, 1).compute_s for d in range(4000)]
    assert all(t is not None and t > 0 for t in times)
    values = [t for t in times if t is not None]
    assert statistics.median(values) == pytest.approx(2.0, rel=0.1)
    # sigma 1: the 99th percentile is e^2.33 ≈ 10x the median, the mean e^0.5 ≈ 1.65x.
    assert sorted(values)[int(0.99 * len(values))] > 6.0 * 2.0
    assert statistics.fmean(values) == pytest.approx(2.0 * math.exp(0.5), rel=0.1)


def test_a_devices_speed_factor_holds_in_every_round() -> None:
    hetero = Heterogeneity(compute_time_s=(1.0, 0.0), speed_sigma=0.8)
    speeds = [hetero.speed(3, d) for d in range(10)]
    assert len(set(speeds)) == 10  # devices differ...
    for device, speed in enumerate(speeds):  # ...and with sigma 0 per task, each is its speed every round
        assert [hetero.draw(3, device, r).compute_s for r in (1, 2, 5)] == pytest.approx([speed] * 3)


def test_adding_compute_times_keeps_the_older_draws() -> None:
    old = Heterogeneity(slowdown=(1.0, 4.0), dropout=0.3, link_delay_s=(0.0, 0.1))
    new = Heterogeneity(slowdown=(1.0, 4.0), dropout=0.3, link_delay_s=(0.0, 0.1), compute_time_s=(1.0, 0.5))
    for device in range(20):
        a, b = old.draw(5, device, 1), new.draw(5, device, 1)
        assert (a.slowdown, a.dropped, a.link_delay_s) == (b.slowdown, b.dropped, b.link_delay_s)
        assert a.compute_s is None and b.compute_s is not None


def test_a_device_reports_no_sooner_than_its_compute_time() -> None:
    # AddPartition's work takes microseconds: only the drawn 0.3 s per task can make two rounds take 0.6 s.
    hetero = Heterogeneity(compute_time_s=(0.3, 0.0))
    result = run_simulation(job_with(num_rounds=2), 3, runner=AddPartition(), heterogeneity=hetero)
    assert [r.num_results for r in result.rounds] == [3, 3]
    assert result.wall_time_s >= 0.6


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"compute_time_s": (0.0, 1.0)}, "compute_time_s"),
        ({"compute_time_s": (1.0, -0.1)}, "compute_time_s"),
        ({"compute_time_s": (math.inf, 1.0)}, "compute_time_s"),
        ({"compute_time_s": (1.0, 1.0), "speed_sigma": -1.0}, "speed_sigma"),
        ({"speed_sigma": 0.5}, "give compute_time_s too"),
    ],
)
def test_bad_delay_settings_are_refused_with_the_setting_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        Heterogeneity(**kwargs)  # type: ignore[arg-type]


JOB = """
name = "delays"
model = "model.npz"

[fedavg]
num_rounds = 1

[simulation.heterogeneity]
compute_time_s = [2.0, 1.0]
speed_sigma = 0.5
dropout = 0.25
"""


def test_the_job_file_s_heterogeneity_table_is_read_and_checked(tmp_path: Path) -> None:
    np.savez(tmp_path / "model.npz", w=np.zeros(4, np.float32))
    path = tmp_path / "job.toml"
    path.write_text(JOB)
    job = SimulationJob.from_file(path)
    assert job.simulation is not None and job.simulation.heterogeneity is not None
    assert Heterogeneity.from_table(job.simulation.heterogeneity) == Heterogeneity(
        compute_time_s=(2.0, 1.0), speed_sigma=0.5, dropout=0.25
    )
    with pytest.raises(InvalidArgument, match=r"unknown key\(s\) sigma; allowed: slowdown"):
        Heterogeneity.from_table({"sigma": 1.0})
    with pytest.raises(InvalidArgument, match=r"simulation.heterogeneity.compute_time_s must be a pair"):
        Heterogeneity.from_table({"compute_time_s": 2.0})
    with pytest.raises(InvalidArgument, match=r"simulation.heterogeneity: heterogeneity.dropout must be in"):
        Heterogeneity.from_table({"dropout": 1.5})
    path.write_text(JOB.split("[simulation.heterogeneity]")[0] + "[simulation]\nheterogeneity = 3\n")
    with pytest.raises(InvalidArgument, match=r"simulation.heterogeneity must be a table"):
        SimulationJob.from_file(path)


def test_the_job_s_heterogeneity_is_used_unless_the_argument_gives_one() -> None:
    table = {"dropout": 0.4}
    job = replace(
        job_with(num_rounds=2, devices_per_round=3, min_results=3),
        simulation=SimulationSection(heterogeneity=table),
    )
    result = run_simulation(job, 8, runner=AddPartition(), seed=2)
    drawn = Heterogeneity(dropout=0.4)
    assert result.dropouts and all(drawn.draw(2, d, r).dropped for d, r in result.dropouts)
    plain = run_simulation(job, 8, runner=AddPartition(), seed=2, heterogeneity=Heterogeneity())
    assert plain.dropouts == ()
