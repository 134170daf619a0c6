"""run_simulation learns, is reproducible, and reports what happened per round and per device."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fedlink.common.errors import InvalidArgument
from fedlink.simulation import Heterogeneity, SimulationJob, run_simulation, run_simulation_async

from .conftest import AddPartition, Digits, job_with, small_model, softmax_job

# The runner quickstart's floor (tests/e2e/runner/test_quickstart_process.py).
QUICKSTART_FLOOR = 0.90


def test_100_devices_learn_digits_to_the_quickstart_floor(digits: Digits, tmp_path: Path) -> None:
    jsonl = tmp_path / "metrics.jsonl"
    result = run_simulation(
        softmax_job(rounds=3, epochs=10), 100, data=digits.source(), seed=0, metrics_jsonl=jsonl
    )
    accuracy = digits.accuracy(result.arrays)
    assert accuracy >= QUICKSTART_FLOOR, result.summary()
    assert [r.round for r in result.rounds] == [1, 2, 3]
    assert all(r.num_devices == 100 and r.num_results == 100 for r in result.rounds)
    losses = [r.metrics["train_loss"] for r in result.rounds]
    assert losses == sorted(losses, reverse=True), losses  # FedAvg on a convex loss: falling
    assert all(rounds == (1, 2, 3) for rounds in result.participation.values())
    assert result.failures == ()
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [line["round"] for line in lines] == [1, 2, 3]
    assert lines[-1]["metrics"]["train_loss"] == pytest.approx(losses[-1])


def test_same_seed_gives_a_bit_identical_model_and_sampling(digits: Digits) -> None:
    def once(seed: int) -> tuple[bytes, dict[int, tuple[int, ...]]]:
        result = run_simulation(softmax_job(rounds=2, fraction=0.5), 12, data=digits.source(), seed=seed)
        return result.model.to_bytes(), dict(result.participation)

    first, second, other = once(7), once(7), once(8)
    assert first[0] == second[0]
    assert first[1] == second[1]
    assert sum(len(r) for r in first[1].values()) == 12  # 6 of 12 devices in each of 2 rounds
    assert other[1] != first[1]  # the seed does choose the devices


def test_device_i_sees_partition_i_of_n_and_the_average_is_fedavgs() -> None:
    result = run_simulation(job_with(num_rounds=2), 5, runner=AddPartition())
    # Each device adds 0.01 * (i + 1) with one example: the mean step is 0.03 per round.
    np.testing.assert_allclose(result.arrays["w"], np.full(4, 0.06, np.float32), rtol=1e-6)
    assert result.rounds[0].metrics["step"] == pytest.approx(0.03)


async def test_run_simulation_works_inside_a_running_event_loop() -> None:
    sync_result = run_simulation(job_with(), 3, runner=AddPartition())  # e.g. a notebook cell
    async_result = await run_simulation_async(job_with(), 3, runner=AddPartition())
    assert sync_result.model.to_bytes() == async_result.model.to_bytes()


def test_dropouts_are_drawn_per_device_and_round_and_replaced() -> None:
    hetero = Heterogeneity(dropout=0.3)
    job = job_with(num_rounds=2, devices_per_round=4, min_results=4)
    result = run_simulation(job, 10, runner=AddPartition(), heterogeneity=hetero, seed=3)
    expected = {(d, r) for r in (1, 2) for d in range(10) if hetero.draw(3, d, r).dropped}
    assert set(result.dropouts) <= expected and result.dropouts
    for device, round_no in result.dropouts:
        assert round_no not in result.participation[device]
    assert all(r.num_results == 4 for r in result.rounds)  # dropped devices were replaced


def test_heterogeneity_draws_are_a_pure_function_of_seed_device_round() -> None:
    hetero = Heterogeneity(slowdown=(1.0, 4.0), dropout=0.5, link_delay_s=(0.0, 0.01))
    assert hetero.draw(1, 2, 3) == hetero.draw(1, 2, 3)
    draws = {hetero.draw(1, d, 1) for d in range(50)}
    assert len(draws) == 50
    assert all(1.0 <= d.slowdown <= 4.0 and 0.0 <= d.link_delay_s <= 0.01 for d in draws)
    with pytest.raises(InvalidArgument, match="dropout"):
        Heterogeneity(dropout=1.0)


def test_a_file_store_is_kept_for_inspection(tmp_path: Path) -> None:
    store = tmp_path / "sim.db"
    result = run_simulation(job_with(), 2, runner=AddPartition(), store=store)
    assert store.exists() and result.store_url.endswith("sim.db")
    with pytest.raises(InvalidArgument, match="exists already"):
        run_simulation(job_with(), 2, runner=AddPartition(), store=store)


def test_unknown_backend_config_keys_are_an_error_listing_the_valid_ones() -> None:
    with pytest.raises(InvalidArgument, match=r"num_gpus.*valid: num_cpus, client_resources"):
        run_simulation(job_with(), 2, runner=AddPartition(), backend_config={"num_gpus": 1})
    with pytest.raises(InvalidArgument, match=r"client_resources key\(s\).*memory.*valid: num_cpus"):
        run_simulation(
            job_with(), 2, runner=AddPartition(), backend_config={"client_resources": {"memory": 1}}
        )
    with pytest.raises(InvalidArgument, match="unknown simulation backend 'gpu'"):
        run_simulation(job_with(), 2, runner=AddPartition(), backend="gpu")


def test_bad_arguments_are_refused_before_anything_runs() -> None:
    with pytest.raises(InvalidArgument, match="num_devices"):
        run_simulation(job_with(), 0, runner=AddPartition())
    with pytest.raises(InvalidArgument, match="no job_data"):
        run_simulation(job_with(), 2)
    both = SimulationJob(
        name="x", workflow=job_with().workflow, model=small_model(), job_data={"components": []}
    )
    with pytest.raises(InvalidArgument, match="not both"):
        run_simulation(both, 2, runner=AddPartition())
