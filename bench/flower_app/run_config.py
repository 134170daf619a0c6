"""One Flower run_simulation of the benchmark's FedAvg workload, timed and checked; runs in the Flower venv.

Started by ``bench/flower_baseline.py`` with the Flower venv's Python; prints one line
``FLOWER_BASELINE_RESULT {json}`` on stdout (Flower's own logs go to stderr). Only numpy is imported at
module level so the fedlink test suite can check the expected-model arithmetic without Flower installed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

RESULT_MARKER = "FLOWER_BASELINE_RESULT "
STEP = 0.001
"""Device i adds ``STEP * (i + 1)`` to every value and reports ``num-examples = i + 1``."""
MODEL_KEY = "model"


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """What one configuration measured, as printed on the result line."""

    devices: int
    floats: int
    rounds: int
    wall_s: float
    ok: bool
    flower_version: str
    ray_version: str
    driver_hwm_mb: float
    max_abs_error: float
    tolerance: float
    client_resources: dict[str, float]
    error: str | None = None


def initial_model(floats: int) -> npt.NDArray[np.float32]:
    """The starting global model: distinct values in [0, 0.99], so a shifted or mixed-up array shows."""
    return (np.arange(floats, dtype=np.int64) % 100).astype(np.float32) / np.float32(100)


def expected_model(initial: npt.NDArray[np.float32], devices: int, rounds: int) -> npt.NDArray[np.float64]:
    """The exact final model (float64) after ``rounds`` of FedAvg over the trivial step.

    Each round the weighted mean of the devices' shifts is ``STEP * Σ(i+1)² / Σ(i+1) = STEP * (2N+1)/3``.
    """
    return initial.astype(np.float64) + rounds * STEP * (2 * devices + 1) / 3


def tolerance(devices: int, rounds: int) -> float:
    """Absolute tolerance for the float32 aggregate of values below 3.

    A float32 weighted sum of N terms of magnitude < 3 drifts by at most about ``N * 3 * 6e-8`` per round;
    ``1e-6 * N`` per round leaves a 5x margin and stays far below the smallest real bug (ignoring the
    weights shifts N=10 by 1.5e-3 per round).
    """
    return 1e-6 * devices * rounds + 1e-5


def _driver_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")  # not Linux: the parent's sampling still measures the tree


def _build_apps(devices: int, floats: int, rounds: int, final: dict[str, Any]) -> tuple[Any, Any]:
    """The ServerApp (FedAvg, every device every round, no evaluation) and the trivial ClientApp."""
    from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

    def train(msg: Message, context: Context) -> Message:
        partition_id = int(context.node_config["partition-id"])
        params = msg.content["arrays"][MODEL_KEY].numpy()
        updated = params + np.float32(STEP * (partition_id + 1))
        content = RecordDict(
            {
                "arrays": ArrayRecord({MODEL_KEY: Array(updated)}),
                "metrics": MetricRecord({"num-examples": partition_id + 1}),
            }
        )
        return Message(content=content, reply_to=msg)

    def count_and_aggregate(records: list[RecordDict], weight_key: str) -> MetricRecord:
        # A lost reply barely moves the average at N=1000, so count the replies each round.
        final.setdefault("replies", []).append(len(records))
        return aggregate_metricrecords(records, weight_key)

    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(
            fraction_train=1.0,
            fraction_evaluate=0.0,
            min_train_nodes=devices,
            min_evaluate_nodes=0,
            min_available_nodes=devices,
            train_metrics_aggr_fn=count_and_aggregate,
        )
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord({MODEL_KEY: Array(initial_model(floats))}),
            num_rounds=rounds,
        )
        final["model"] = result.arrays[MODEL_KEY].numpy()

    # Registered by call rather than decorator syntax: Flower ships no stubs for fedlink's mypy.
    client_app = ClientApp()
    client_app.train()(train)
    server_app = ServerApp()
    server_app.main()(main)
    return server_app, client_app


def run(devices: int, floats: int, rounds: int, client_cpus: float | None) -> RunOutcome:
    """Runs Flower's run_simulation once (imports first, then the timed call) and checks the final model."""
    import flwr
    from flwr.simulation import run_simulation

    final: dict[str, Any] = {}
    server_app, client_app = _build_apps(devices, floats, rounds, final)
    # address="local": always a fresh Ray instance, never a `ray start` cluster someone else runs here.
    backend_config: dict[str, Any] = {"init_args": {"address": "local"}}
    if client_cpus is not None:
        backend_config["client_resources"] = {"num_cpus": client_cpus, "num_gpus": 0.0}
    resources = backend_config.get("client_resources", {"num_cpus": 2.0, "num_gpus": 0.0})
    limit = tolerance(devices, rounds)
    error: str | None = None
    start = time.perf_counter()
    try:
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=devices,
            backend_config=backend_config,
        )
    except Exception as exc:  # reported on the result line: the parent records the failure, not a crash
        error = f"{type(exc).__name__}: {exc}"
    wall = time.perf_counter() - start
    max_error = float("nan")
    if error is None and "model" not in final:
        error = "the ServerApp finished without a final model"
    if error is None:
        expected = expected_model(initial_model(floats), devices, rounds)
        max_error = float(np.max(np.abs(final["model"].astype(np.float64) - expected)))
        if final.get("replies") != [devices] * rounds:
            error = f"replies per round {final.get('replies')}, expected {[devices] * rounds}"
        elif not max_error <= limit:
            error = f"final model off by {max_error:.3g} (tolerance {limit:.3g})"
    return RunOutcome(
        devices=devices,
        floats=floats,
        rounds=rounds,
        wall_s=wall,
        ok=error is None,
        flower_version=flwr.__version__,
        ray_version=importlib.metadata.version("ray"),
        driver_hwm_mb=_driver_hwm_mb(),
        max_abs_error=max_error,
        tolerance=limit,
        client_resources={k: float(v) for k, v in resources.items()},
        error=error,
    )


def main(argv: list[str] | None = None) -> int:
    """Parses the configuration, runs it and prints the result line."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--floats", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client-cpus", type=float, default=None, help="client_resources num_cpus")
    args = parser.parse_args(argv)
    if os.environ.get("FLWR_TELEMETRY_ENABLED") != "0":
        print("warning: Flower telemetry is on; it may wait on the network", file=sys.stderr)
    outcome = run(args.devices, args.floats, args.rounds, args.client_cpus)
    print(RESULT_MARKER + json.dumps(asdict(outcome)), flush=True)
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
