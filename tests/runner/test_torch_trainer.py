"""The PyTorch trainer: it learns, returns a WEIGHT_DIFF FedAvg can weigh, is bit-reproducible per seed,
builds its model once, and refuses what it cannot do with a message that says why.

Without torch these tests skip loudly; in CI (``CI`` set) torch must be there (``.ci/test`` installs
the CPU build).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import pickle
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

if os.environ.get("CI") and importlib.util.find_spec("torch") is None:
    pytest.fail("torch is not installed in CI: .ci/test must install the CPU build", pytrace=False)
pytest.importorskip("torch", reason="the PyTorch trainer needs torch: pip install 'fedlink[torch]'")

import torch

from fedlink.common.dxo import DXO, DataKind, MetaKey, weight_of
from fedlink.common.errors import FailedPrecondition, InvalidArgument
from fedlink.runner import Aborted, Context, ContextKey, Signal
from fedlink.runner.config import ResolverRegistry, process_job_data
from fedlink.runner.data import ArrayDataSource
from fedlink.runner.executors.torch import Batches, TorchTask, TorchTrainer, load_arrays, state_dict_to_arrays
from fedlink.runner.handlers import LossRecorder
from fedlink.runner.spec import DataSource

from .conftest import Split


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread: these models are tiny, and on a busy 2-core machine PyTorch's threads
    wait on each other far longer than they compute (a 2 s test took 15 s under a load of 11)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class MLP(torch.nn.Module):
    """64 -> 32 -> 10, optionally with BatchNorm (float running stats, an int64 step counter)."""

    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 32)
        self.norm = torch.nn.BatchNorm1d(32) if batch_norm else torch.nn.Identity()
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.norm(self.fc1(x))))
        return out


class MLPTrainer(TorchTrainer):
    """The subclassing way: only the model is defined."""

    def build_model(self) -> torch.nn.Module:
        return MLP()


class BatchNormTrainer(TorchTrainer):
    def build_model(self) -> torch.nn.Module:
        return MLP(batch_norm=True)


def initial(model: torch.nn.Module, seed: int = 0) -> DXO:
    """The WEIGHTS DXO of a model initialised from ``seed``, read-only as the wire hands it out."""
    torch.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.reset_parameters()
    dxo = DXO.from_bytes(DXO(kind=DataKind.WEIGHTS, data=state_dict_to_arrays(model.state_dict())).to_bytes())
    dxo.meta[MetaKey.MODEL_VERSION] = 3
    return dxo


def ctx(
    source: DataSource, task: str = "train", *, partition: int = 0, handlers: list[Any] | None = None
) -> Context:
    return Context(
        {
            ContextKey.DATA_SOURCE: source,
            ContextKey.TASK_NAME: task,
            ContextKey.PARTITION_ID: partition,
            ContextKey.EVENT_HANDLERS: handlers or [],
        }
    )


def applied(model: DXO, diff: DXO) -> dict[str, npt.NDArray[Any]]:
    assert diff.kind == DataKind.WEIGHT_DIFF
    return {name: model.data[name] + diff.data[name] for name in model.data}


def held_out_accuracy(
    arrays: Mapping[str, npt.NDArray[Any]], digits: Split, *, batch_norm: bool = False
) -> float:
    net = MLP(batch_norm=batch_norm)
    load_arrays(net, arrays)
    net.eval()
    with torch.no_grad():
        predicted = net(torch.from_numpy(digits[1])).argmax(dim=1).numpy()
    return float(np.mean(predicted == digits[3]))


def test_training_learns_the_digits_and_returns_a_weight_diff_fedavg_can_weigh(
    digits: Split, digits_source: ArrayDataSource
) -> None:
    trainer = MLPTrainer(epochs=5, batch_size=32, learning_rate=0.1, momentum=0.9)
    model = initial(MLP())
    recorder = LossRecorder()
    result = trainer.execute(model, ctx(digits_source, handlers=[recorder]), Signal())
    assert result.kind == DataKind.WEIGHT_DIFF
    assert sorted(result.data) == sorted(model.data)
    assert all(result.data[name].dtype == model.data[name].dtype for name in model.data)
    n = len(digits[0])
    assert result.meta[MetaKey.NUM_EXAMPLES] == n and weight_of(result) == n
    assert result.meta[MetaKey.NUM_STEPS_CURRENT_ROUND] == 5 * math.ceil(n / 32)
    losses = [r.loss for r in recorder.records]
    assert len(losses) == 5 and losses[-1] < losses[0] / 3, losses
    assert result.meta["train_loss"] == pytest.approx(losses[-1])
    assert isinstance(result.meta["train_accuracy"], float) and result.meta["train_accuracy"] > 0.95
    assert held_out_accuracy(applied(model, result), digits) > 0.9
    assert "val_loss" not in result.meta  # the source has no "valid" dataset


def test_batch_norm_buffers_travel_with_their_dtypes_and_an_exact_step_count(digits: Split) -> None:
    x_train, _, y_train, _ = digits
    source = ArrayDataSource({"train": (x_train[:200], y_train[:200])})
    model = initial(MLP(batch_norm=True))
    result = BatchNormTrainer(epochs=2, batch_size=50).execute(model, ctx(source), Signal())
    counter = result.data["norm.num_batches_tracked"]
    assert isinstance(counter, np.ndarray) and counter.shape == ()  # a 0-d array, as the DXO needs
    assert counter.dtype == np.int64 and counter == 8  # 2 epochs of 4 batches: an integer diff, exact
    DXO.from_bytes(result.to_bytes())
    assert result.data["norm.running_mean"].dtype == np.float32
    assert np.any(result.data["norm.running_mean"] != 0)


def test_float64_float16_and_bfloat16_entries_keep_their_dtype_in_the_diff(
    digits_source: ArrayDataSource,
) -> None:
    class Wide(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(64, 10).double()
            self.register_buffer("halves", torch.ones(3, dtype=torch.float16))
            self.register_buffer("bf16", torch.ones(2, dtype=torch.bfloat16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.fc(x)
            return out

    model = DXO(kind=DataKind.WEIGHTS, data=state_dict_to_arrays(Wide().state_dict()))
    result = TorchTrainer(model_fn=Wide).execute(model, ctx(digits_source), Signal())
    assert result.data["fc.weight"].dtype == np.float64  # the inputs were fed as float64 too
    assert result.data["halves"].dtype == np.float16 and not result.data["halves"].any()
    assert result.data["bf16"].dtype == model.data["bf16"].dtype  # bfloat16 (ml_dtypes) in and out
    assert DXO.from_bytes(result.to_bytes()).data["bf16"].dtype == model.data["bf16"].dtype


def test_the_same_seed_gives_bit_identical_results_and_the_seed_partition_and_version_matter(
    digits_source: ArrayDataSource,
) -> None:
    model = initial(MLP())

    def once(trainer: TorchTrainer, *, partition: int = 0, dxo: DXO = model) -> bytes:
        return trainer.execute(dxo, ctx(digits_source, partition=partition), Signal()).to_bytes()

    trainer = MLPTrainer(epochs=1, seed=5)
    first = once(trainer)
    assert once(MLPTrainer(epochs=1, seed=5)) == first  # a fresh trainer and module
    assert once(trainer) == first  # the same module, lent again: nothing carried over
    assert once(MLPTrainer(epochs=1, seed=6)) != first
    assert once(trainer, partition=1) != first
    later = DXO(kind=DataKind.WEIGHTS, data=model.data, meta={MetaKey.MODEL_VERSION: 4})
    assert once(trainer, dxo=later) != first
    assert trainer.models_built == 1


def test_evaluate_tasks_report_metrics_without_training(
    digits: Split, digits_source: ArrayDataSource
) -> None:
    trainer = MLPTrainer(epochs=3, learning_rate=0.1, momentum=0.9)
    model = initial(MLP())
    trained = DXO(
        kind=DataKind.WEIGHTS, data=applied(model, trainer.execute(model, ctx(digits_source), Signal()))
    )
    result = trainer.execute(trained, ctx(digits_source, "evaluate"), Signal())
    assert result.kind == DataKind.METRICS
    assert result.meta == {MetaKey.NUM_EXAMPLES: len(digits[3]), "dataset_type": "test"}
    assert {k: v.dtype for k, v in result.data.items()} == {"loss": np.float64, "accuracy": np.float64}
    assert float(result.data["accuracy"]) == pytest.approx(held_out_accuracy(trained.data, digits))
    asked = DXO(kind=DataKind.WEIGHTS, data=trained.data, meta={"dataset_type": "train"})
    assert trainer.execute(asked, ctx(digits_source, "validate"), Signal()).meta["dataset_type"] == "train"
    only_train = ArrayDataSource({"train": (digits[0], digits[2])})
    with pytest.raises(FailedPrecondition, match=r"no non-empty dataset among \['valid', 'test'\]"):
        trainer.execute(trained, ctx(only_train, "evaluate"), Signal())


def test_a_valid_dataset_adds_val_metrics_to_the_training_result(digits: Split) -> None:
    x_train, x_test, y_train, y_test = digits
    source = ArrayDataSource({"train": (x_train, y_train), "valid": (x_test, y_test)})
    result = MLPTrainer(learning_rate=0.1).execute(initial(MLP()), ctx(source), Signal())
    assert {"val_loss", "val_accuracy"} <= set(result.meta)


def test_functions_may_replace_the_model_the_loop_and_the_evaluation(digits_source: ArrayDataSource) -> None:
    seen: list[tuple[int, str]] = []

    def train(model: torch.nn.Module, batches: Batches, task: TorchTask) -> dict[str, Any]:
        seen.append((task.epochs, task.dataset_type))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        for inputs, labels in batches:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            torch.autograd.backward(loss)
            optimizer.step()
        return {"my_loss": loss.detach(), "optimizer": "adam"}  # a 0-d tensor is turned into a float

    def evaluate(model: torch.nn.Module, batches: Batches, task: TorchTask) -> dict[str, float]:
        return {"samples": float(sum(len(labels) for _, labels in batches))}

    trainer = TorchTrainer(epochs=2, model_fn=MLP, train_fn=train, evaluate_fn=evaluate)
    model = initial(MLP())
    result = trainer.execute(model, ctx(digits_source), Signal())
    assert seen == [(2, "train")]
    assert isinstance(result.meta["my_loss"], float) and result.meta["optimizer"] == "adam"
    assert MetaKey.NUM_STEPS_CURRENT_ROUND not in result.meta  # only what train_fn returned, and the count
    evaluation = trainer.execute(model, ctx(digits_source, "evaluate"), Signal())
    assert float(evaluation.data["samples"]) == evaluation.meta[MetaKey.NUM_EXAMPLES]


def test_a_job_config_builds_it_from_an_app_registry(digits_source: ArrayDataSource) -> None:
    registry = ResolverRegistry({"DigitsMLP": functools.partial(TorchTrainer, model_fn=MLP)})
    config = process_job_data(
        '{"components": [{"type": "DigitsMLP", "name": "trainer", "args": {"epochs": 1, "seed": 2}}]}',
        registry,
    )
    trainer = config.executor_for("train")
    assert isinstance(trainer, TorchTrainer) and trainer.seed == 2 and trainer.model_fn is MLP
    assert trainer.execute(initial(MLP()), ctx(digits_source), Signal()).kind == DataKind.WEIGHT_DIFF


def test_one_module_serves_every_task_and_concurrent_tasks_get_their_own(
    digits_source: ArrayDataSource,
) -> None:
    built: list[int] = []
    lock = threading.Lock()

    def make() -> torch.nn.Module:
        with lock:
            built.append(threading.get_ident())
        return MLP()

    trainer = TorchTrainer(epochs=1, model_fn=make)
    model = initial(MLP())
    for _ in range(4):
        trainer.execute(model, ctx(digits_source), Signal())
    assert len(built) == 1 and trainer.models_built == 1
    with ThreadPoolExecutor(3) as pool:
        results = list(
            pool.map(lambda i: trainer.execute(model, ctx(digits_source, partition=i), Signal()), range(9))
        )
    assert 1 <= trainer.models_built <= 3 and len(built) == trainer.models_built
    # Concurrent tasks on lent modules give the bits a task alone gives.
    alone = TorchTrainer(epochs=1, model_fn=MLP).execute(model, ctx(digits_source, partition=4), Signal())
    assert results[4].to_bytes() == alone.to_bytes()


def test_an_idle_module_keeps_no_gradients(digits_source: ArrayDataSource) -> None:
    # Gradients of the last step are a model's worth of memory per idle module, and of no use to the
    # next task (it loads a new global model); a custom train_fn's are dropped too.
    modules: list[torch.nn.Module] = []

    def train(net: torch.nn.Module, batches: Batches, task: TorchTask) -> dict[str, float]:
        modules.append(net)
        for x, y in batches:
            torch.autograd.backward(torch.nn.functional.cross_entropy(net(x), y))
        return {}

    for trainer in (TorchTrainer(epochs=1, model_fn=MLP), TorchTrainer(model_fn=MLP, train_fn=train)):
        trainer.execute(initial(MLP()), ctx(digits_source), Signal())
        (module,) = modules if trainer.train_fn else trainer._idle
        assert all(p.grad is None for p in module.parameters())


def test_a_pickled_trainer_keeps_its_settings_but_not_its_modules(digits_source: ArrayDataSource) -> None:
    trainer = MLPTrainer(epochs=1, learning_rate=0.2, seed=9)
    first = trainer.execute(initial(MLP()), ctx(digits_source), Signal())
    copy = pickle.loads(pickle.dumps(trainer))
    assert copy.models_built == 0 and copy.learning_rate == 0.2
    assert copy.execute(initial(MLP()), ctx(digits_source), Signal()).to_bytes() == first.to_bytes()


def test_the_abort_signal_stops_training_between_batches(digits_source: ArrayDataSource) -> None:
    signal = Signal()

    def train(model: torch.nn.Module, batches: Batches, task: TorchTask) -> None:
        for count, _ in enumerate(batches):
            if count == 2:
                signal.trigger("runner stopping")
            task.abort_signal.check()

    with pytest.raises(Aborted, match="runner stopping"):
        TorchTrainer(model_fn=MLP, train_fn=train).execute(initial(MLP()), ctx(digits_source), signal)


def test_a_diverging_loss_is_an_error_that_names_the_step(digits: Split) -> None:
    huge = ArrayDataSource({"train": (digits[0] * np.float32(1e38), digits[2])})  # overflows in fc1
    with pytest.raises(InvalidArgument, match=r"training diverged \(loss inf at step 0 of epoch 0\)"):
        MLPTrainer().execute(initial(MLP()), ctx(huge), Signal())


def test_wrong_models_and_tasks_are_refused_with_a_reason(digits_source: ArrayDataSource) -> None:
    model = initial(MLP())
    with pytest.raises(FailedPrecondition, match="give model_fn or override build_model"):
        TorchTrainer().execute(model, ctx(digits_source), Signal())
    with pytest.raises(InvalidArgument, match=r"must be a torch\.nn\.Module, not dict"):
        TorchTrainer(model_fn=dict).execute(model, ctx(digits_source), Signal())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="needs a WEIGHTS DXO"):
        MLPTrainer().execute(DXO(kind=DataKind.WEIGHT_DIFF, data=model.data), ctx(digits_source), Signal())
    with pytest.raises(InvalidArgument, match=r"missing \['fc2.bias'\]"):
        partial = {k: v for k, v in model.data.items() if k != "fc2.bias"}
        MLPTrainer().execute(DXO(kind=DataKind.WEIGHTS, data=partial), ctx(digits_source), Signal())

    class Flagged(MLP):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.zeros(3, dtype=torch.bool))

    flagged = DXO(kind=DataKind.WEIGHTS, data=state_dict_to_arrays(Flagged().state_dict()))
    with pytest.raises(InvalidArgument, match=r"'seen' is bool.*persistent=False"):
        TorchTrainer(model_fn=Flagged).execute(flagged, ctx(digits_source), Signal())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"epochs": 0}, "epochs must be an integer >= 1"),
        ({"learning_rate": 0}, "learning_rate must be > 0"),
        ({"momentum": -1}, "momentum must be >= 0"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"device": "toaster"}, "device must be a torch device"),
        ({"device": "cuda"}, "CUDA is not available here"),
        ({"num_threads": 0}, "num_threads must be an integer >= 1"),
        ({"model_fn": 3}, "model_fn must be callable"),
    ],
)
def test_bad_args_are_refused_by_name(args: dict[str, Any], message: str) -> None:
    if args.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(InvalidArgument, match=message):
        TorchTrainer(**args)
