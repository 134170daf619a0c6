"""The built-in filters on the PyTorch trainer's results: float16, top-k, exclude and DP, through the
wire encoding, and what the coordinator then accepts as an update of the model.

Without torch these tests skip loudly; in CI (``CI`` set) torch must be there (``.ci/test`` installs
the CPU build).
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

if os.environ.get("CI") and importlib.util.find_spec("torch") is None:
    pytest.fail("torch is not installed in CI: .ci/test must install the CPU build", pytrace=False)
pytest.importorskip("torch", reason="the PyTorch trainer needs torch: pip install 'fedlink[torch]'")

import torch

from fedlink.common.dxo import DXO, DataKind, MetaKey
from fedlink.common.errors import InvalidArgument
from fedlink.common.tensors import TensorEncoding
from fedlink.runner import Context, ContextKey, Signal
from fedlink.runner.data import ArrayDataSource
from fedlink.runner.executors.torch import TorchTrainer, state_dict_to_arrays
from fedlink.runner.filters import ExcludeVariables, Float16Compression, GaussianPrivacy, TopKSparsification
from fedlink.runner.spec import Filter
from fedlink.server.domain.updates import check_update, model_spec

from .conftest import Split


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread: a tiny model on a busy 2-core machine (see test_torch_trainer.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Net(torch.nn.Module):
    """A classifier with BatchNorm, so its state_dict holds an int64 buffer beside the floats."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.norm(self.fc1(x))))
        return out


@pytest.fixture(scope="module")
def trained(digits: Split) -> tuple[DXO, DXO]:
    """The global model (as the wire delivers it) and one device's result on 300 digits."""
    torch.manual_seed(0)
    model = DXO.from_bytes(
        DXO(kind=DataKind.WEIGHTS, data=state_dict_to_arrays(Net().state_dict())).to_bytes()
    )
    source = ArrayDataSource({"train": (digits[0][:300], digits[2][:300])})
    ctx = Context({ContextKey.DATA_SOURCE: source, ContextKey.TASK_NAME: "train", ContextKey.PARTITION_ID: 0})
    result = TorchTrainer(epochs=2, learning_rate=0.1, model_fn=Net).execute(model, ctx, Signal())
    return model, result


def through(result: DXO, filters: Sequence[Filter]) -> DXO:
    """Applies the out-filters in order, then sends the result over the wire and decodes it there."""
    ctx = Context({ContextKey.PARTITION_ID: 0, ContextKey.TASK_NAME: "train"})
    for f in filters:
        result = f.filter(result, ctx, Signal())
    return DXO.from_bytes(result.to_bytes())


def test_float16_marks_the_float_entries_and_leaves_the_step_counter_dense(trained: tuple[DXO, DXO]) -> None:
    model, result = trained
    marked = Float16Compression().filter(result, Context(), Signal())
    floats = {name for name, value in result.data.items() if value.dtype.kind == "f"}
    assert {n for n, e in marked.encodings.items() if e == TensorEncoding.FLOAT16} == floats
    assert "norm.num_batches_tracked" not in marked.encodings
    received = DXO.from_bytes(marked.to_bytes())
    check_update(received.data, model_spec(model.data), allow_missing=False)  # dtypes restored on receipt
    for name in floats:
        np.testing.assert_allclose(received.data[name], result.data[name], rtol=1e-3, atol=1e-4)
    assert received.data["norm.num_batches_tracked"] == result.data["norm.num_batches_tracked"] == 20


def test_top_k_keeps_the_largest_entries_of_every_float_entry(trained: tuple[DXO, DXO]) -> None:
    model, result = trained
    received = through(result, [TopKSparsification(fraction=0.1)])
    check_update(received.data, model_spec(model.data), allow_missing=False)
    weight, sent = result.data["fc1.weight"], received.data["fc1.weight"]
    kept = np.count_nonzero(sent)
    assert kept == math.ceil(0.1 * weight.size)
    assert np.min(np.abs(weight[sent != 0])) >= np.max(np.abs(weight[sent == 0]))
    assert received.data["norm.num_batches_tracked"] == 20  # an integer entry passes through


def test_exclude_keeps_personal_layers_and_buffers_on_the_device(trained: tuple[DXO, DXO]) -> None:
    model, result = trained
    received = through(result, [ExcludeVariables(globs=["head.*", "*.num_batches_tracked"])])
    assert sorted(received.data) == sorted(
        n for n in model.data if not n.startswith("head.") and "num_b" not in n
    )
    check_update(received.data, model_spec(model.data))  # FedAvg averages what a result carries
    assert received.meta["excluded_variables"] == ["head.bias", "head.weight", "norm.num_batches_tracked"]
    assert received.meta[MetaKey.NUM_EXAMPLES] == 300


def test_dp_needs_the_integer_buffer_left_out_and_then_clips_and_noises(trained: tuple[DXO, DXO]) -> None:
    model, result = trained
    dp = GaussianPrivacy(clip_norm=0.5, noise_multiplier=0.0, seed=1)
    with pytest.raises(InvalidArgument, match=r"'norm\.num_batches_tracked' is int64, not float"):
        through(result, [dp])
    received = through(result, [ExcludeVariables(globs=["*.num_batches_tracked"]), dp])
    check_update(received.data, model_spec(model.data))
    norm = math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in received.data.values()))
    update_norm = received.meta["dp_update_norm"]
    assert isinstance(update_norm, float) and update_norm > 0.5  # it was clipped...
    assert norm == pytest.approx(0.5, rel=1e-5)  # ...to exactly clip_norm
    noisy = through(
        result, [ExcludeVariables(globs=["*.num_batches_tracked"]), GaussianPrivacy(0.5, 1.0, seed=1)]
    )
    assert all(v.dtype == np.float32 for v in noisy.data.values())
    assert not np.allclose(noisy.data["fc1.weight"], received.data["fc1.weight"])


def test_compression_after_exclusion_and_dp_composes(trained: tuple[DXO, DXO]) -> None:
    model, result = trained
    chain: list[Filter] = [
        ExcludeVariables(globs=["*.num_batches_tracked"]),
        GaussianPrivacy(clip_norm=1.0, noise_multiplier=0.1, seed=2),
        TopKSparsification(fraction=0.25),
        Float16Compression(),  # leaves the sparse entries as they are
    ]
    received = through(result, chain)
    check_update(received.data, model_spec(model.data))
    assert set(received.meta) >= {"excluded_variables", "dp_noise_std", "topk_kept", "float16_variables"}
    assert received.meta["float16_variables"] == 0  # every float entry was already sparse
