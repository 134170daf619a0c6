"""A job config driving the whole device-side pipeline, and the runner's import-time dependencies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench.orphans import tied
from fedlink.common.dxo import DXO, DataKind, weight_of
from fedlink.common.tensors import TensorEncoding
from fedlink.runner import Context, ContextKey, Signal, process_job_data
from fedlink.runner.data import PartitionedDataSource
from fedlink.runner.executors import SoftmaxRegressionTrainer
from fedlink.runner.handlers import LossRecorder

from .conftest import Split


def test_job_config_builds_a_working_train_pipeline(tmp_path: Path, digits: Split) -> None:
    x_train, x_test, y_train, y_test = digits
    path = tmp_path / "digits.npz"
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    job_data = json.dumps(
        {
            "components": [
                {"type": "SoftmaxRegressionTrainer", "name": "trainer",
                 "args": {"epochs": 2, "learning_rate": 0.2, "data_source": "@partition"}},
                {"type": "PartitionedDataSource", "name": "partition",
                 "args": {"source": "@files", "method": "dirichlet", "alpha": 0.5}},
                {"type": "NpzDataSource", "name": "files", "args": {"path": str(path)}},
                {"type": "GaussianPrivacy", "name": "dp",
                 "args": {"clip_norm": 0.5, "noise_multiplier": 0.01, "seed": 1}},
                {"type": "TopKSparsification", "name": "topk", "args": {"fraction": 0.25}},
                {"type": "LossRecorder", "name": "losses"},
            ],
            "executors": {"*": "@trainer"},
            "out_filters": ["@dp", "@topk"],
            "handlers": ["@losses"],
        }
    )  # fmt: skip
    config = process_job_data(job_data)
    # What the Runner does per task, minus the transport.
    ctx = Context(
        {
            ContextKey.COMPONENTS: config.components,
            ContextKey.EVENT_HANDLERS: list(config.handlers),
            ContextKey.TASK_NAME: "train",
            ContextKey.PARTITION_ID: 1,
            ContextKey.NUM_PARTITIONS: 3,
        }
    )
    task = DXO(kind=DataKind.WEIGHTS, data=SoftmaxRegressionTrainer.init_weights(64, 10))
    result = config.executor_for("train").execute(task, ctx, Signal())
    for out_filter in config.out_filters:
        result = out_filter.filter(result, ctx, Signal())

    partition = config.components["partition"]
    assert isinstance(partition, PartitionedDataSource)
    own_partition = partition.get_dataset("train", ctx).size()
    assert 0 < own_partition < len(x_train)
    assert weight_of(result) == own_partition
    assert set(result.encodings.values()) == {TensorEncoding.SPARSE}
    assert result.meta["dp_clip_norm"] == 0.5 and result.meta["topk_kept"] == {"weight": 160, "bias": 3}
    losses = config.handlers[0]
    assert isinstance(losses, LossRecorder) and [r.epoch for r in losses.records] == [0, 1]
    decoded = DXO.from_bytes(result.to_bytes())
    np.testing.assert_array_equal(decoded.data["weight"], result.data["weight"])


def test_the_runner_package_imports_only_its_small_dependency_set() -> None:
    code = (
        "import sys, fedlink.runner, fedlink.runner.builtins, fedlink.runner.data;"
        "heavy = {'sklearn', 'sqlalchemy', 'scipy', 'alembic'};"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & heavy);"
        "print(','.join(heavy))"
    )
    out = subprocess.run(
        tied([sys.executable, "-c", code]),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "", f"fedlink.runner imports {out.stdout.strip()}"
