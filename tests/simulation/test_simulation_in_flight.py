"""The in-process transport bounds the results in flight: work started, report not yet answered."""

from __future__ import annotations

import threading
import weakref

import numpy as np
import pytest

from fedlink.common.dxo import DXO
from fedlink.runner.context import Context, Signal
from fedlink.simulation import Heterogeneity, engine, run_simulation
from fedlink.simulation.engine import in_flight_limit, round_check_seconds

from .conftest import AddPartition, job_with


class CountsLiveResults(AddPartition):
    """AddPartition that counts the results alive (made, not yet freed) whenever it makes one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live = 0
        self.most = 0
        self.made = 0

    def _freed(self) -> None:
        with self._lock:
            self.live -= 1

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        out = super().execute(dxo, ctx, abort_signal)
        with self._lock:
            self.live += 1
            self.made += 1
            self.most = max(self.most, self.live)
        weakref.finalize(out.data["w"], self._freed)
        return out


@pytest.mark.parametrize("heterogeneity", [None, Heterogeneity(link_delay_s=(0.0, 0.01))])
def test_no_more_results_alive_than_the_limit(
    monkeypatch: pytest.MonkeyPatch, heterogeneity: Heterogeneity | None
) -> None:
    # One worker thread, and a byte budget smaller than one result: the floor of two in flight.
    monkeypatch.setattr(engine, "_IN_FLIGHT_BYTES", 1)
    executor = CountsLiveResults()
    result = run_simulation(
        job_with(num_rounds=2),
        40,
        runner=executor,
        backend_config={"num_cpus": 1},
        heterogeneity=heterogeneity,
    )
    assert [r.num_results for r in result.rounds] == [40, 40]
    assert executor.made == 80
    if heterogeneity is None:
        assert 1 <= executor.most <= 2, executor.most
    # else: a device waiting out its link delay gives its slot back (a slow device must not hold up
    # the others) but keeps its result, so only the run's outcome is checked.
    np.testing.assert_allclose(result.arrays["w"], np.full(4, 2 * 0.205, np.float32), rtol=1e-5)


def test_the_limit_follows_the_model_size() -> None:
    assert in_flight_limit(40_000, 2) == 1024  # small models: capped
    assert in_flight_limit(4_000_000, 2) == 67  # 1,000,000 floats: about 256 MB of results
    assert in_flight_limit(10**9, 8) == 16  # never fewer than twice the workers
    assert round_check_seconds(10) == 0.05
    assert round_check_seconds(1_000) == pytest.approx(0.1)
    assert round_check_seconds(100_000) == 0.5
