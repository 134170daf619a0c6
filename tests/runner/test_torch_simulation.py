"""The PyTorch trainer in the simulation: devices learn, and a model is built per worker, not per device.

Without torch these tests skip loudly; in CI (``CI`` set) torch must be there (``.ci/test`` installs
the CPU build).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

if os.environ.get("CI") and importlib.util.find_spec("torch") is None:
    pytest.fail("torch is not installed in CI: .ci/test must install the CPU build", pytrace=False)
pytest.importorskip("torch", reason="the PyTorch trainer needs torch: pip install 'fedlink[torch]'")

import torch

from bench.orphans import tied
from fedlink.runner.config import ResolverRegistry
from fedlink.runner.data import ArrayDataSource, PartitionedDataSource
from fedlink.runner.executors.torch import TorchTrainer, load_arrays, state_dict_to_arrays
from fedlink.server.workflows.fedavg import FedAvgParams
from fedlink.simulation import SimulationJob, run_simulation

from .conftest import Split

DEVICES = 6
#: The local backend's pool: tasks running at once, so at most this many modules are built.
WORKERS = 2


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread per task: the pool runs tasks side by side (see test_torch_trainer.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(x)))
        return out


class CountingFactory:
    """``model_fn`` that counts the modules it builds (from any thread)."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self) -> torch.nn.Module:
        with self._lock:
            self.count += 1
        return Net()


def job(rounds: int) -> SimulationJob:
    torch.manual_seed(0)
    trainer = {"epochs": 2, "batch_size": 16, "learning_rate": 0.1, "momentum": 0.5, "seed": 0}
    return SimulationJob(
        name="torch-digits",
        workflow=FedAvgParams(num_rounds=rounds, round_timeout_s=60.0, evaluate=True),
        model={k: np.array(v) for k, v in state_dict_to_arrays(Net().state_dict()).items()},
        job_data={"components": [{"type": "DigitsNet", "name": "trainer", "args": trainer}]},
    )


def source(digits: Split) -> PartitionedDataSource:
    x_train, x_test, y_train, y_test = digits
    whole = ArrayDataSource({"train": (x_train, y_train), "test": (x_test, y_test)})
    return PartitionedDataSource(whole, method="dirichlet", alpha=1.0, seed=0)


def held_out_accuracy(arrays: dict[str, Any], digits: Split) -> float:
    net = Net()
    load_arrays(net, arrays)
    with torch.no_grad():
        predicted = net(torch.from_numpy(digits[1])).argmax(dim=1).numpy()
    return float(np.mean(predicted == digits[3]))


def test_devices_learn_and_share_one_module_per_worker(digits: Split) -> None:
    factory = CountingFactory()
    registry = ResolverRegistry({"DigitsNet": lambda **args: TorchTrainer(model_fn=factory, **args)})
    result = run_simulation(
        job(rounds=3), DEVICES, runner=registry, data=source(digits), backend_config={"num_cpus": WORKERS}
    )
    assert result.failures == ()
    accuracy = [r.metrics["eval_accuracy"] for r in result.rounds]
    assert accuracy[-1] > accuracy[0] and accuracy[-1] > 0.85, accuracy
    assert held_out_accuracy(dict(result.arrays), digits) == pytest.approx(accuracy[-1])
    # 6 devices x 3 rounds x (train + evaluate) = 36 tasks, on modules built once per worker.
    assert 1 <= factory.count <= WORKERS, factory.count


def test_without_shared_components_each_device_builds_its_own(digits: Split) -> None:
    factory = CountingFactory()
    registry = ResolverRegistry({"DigitsNet": lambda **args: TorchTrainer(model_fn=factory, **args)})
    run_simulation(job(rounds=1), DEVICES, runner=registry, data=source(digits), share_components=False)
    assert factory.count == DEVICES


def test_the_same_job_twice_gives_the_same_bits(digits: Split) -> None:
    registry = ResolverRegistry({"DigitsNet": lambda **args: TorchTrainer(model_fn=Net, **args)})

    def once() -> bytes:
        run = run_simulation(job(rounds=2), DEVICES, runner=registry, data=source(digits), seed=3)
        return run.model.to_bytes()

    assert once() == once()


def test_importing_the_runner_and_its_builtins_does_not_import_torch() -> None:
    code = (
        "import sys, fedlink.runner, fedlink.runner.builtins, fedlink.runner.executors;"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        tied([sys.executable, "-c", code]), capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False", "the base runner install must not need torch"
