"""The PyTorch trainer: an executor that trains a ``torch.nn.Module`` on the device's data.

Two ways to give it the model and, optionally, the training and evaluation code:

* **subclass** :class:`TorchTrainer` and override :meth:`~TorchTrainer.build_model` (and, if the
  default supervised loop does not fit, :meth:`~TorchTrainer.train` / :meth:`~TorchTrainer.evaluate`,
  or the smaller hooks :meth:`~TorchTrainer.loss`, :meth:`~TorchTrainer.build_optimizer`,
  :meth:`~TorchTrainer.to_tensors`, :meth:`~TorchTrainer.batches`);
* **hand over functions**: ``TorchTrainer(model_fn=Net, train_fn=train, evaluate_fn=test)``, where
  ``train_fn(model, batches, task)`` and ``evaluate_fn(model, batches, task)`` have the signatures of
  the methods they replace. In a job config the functions come from an app's
  :class:`~fedlink.runner.config.ResolverRegistry`, e.g. ``registry.register("Digits",
  functools.partial(TorchTrainer, model_fn=Net))``, and ``job_data`` gives the rest of the args.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, TensorDataset

from fedlink.common.dxo import DXO, DataKind, MetaKey, MetaValue
from fedlink.common.errors import FailedPrecondition, InvalidArgument, NotFound
from fedlink.runner.context import Context, ContextKey, EventType, Signal
from fedlink.runner.executors.base import (
    DEFAULT_EVALUATE_TASKS,
    _model_version,
    _number,
    _partition_id,
    _positive_int,
)
from fedlink.runner.executors.torch.convert import load_arrays, tensor_to_array
from fedlink.runner.spec import DataSource

__all__ = ["Batches", "EvaluateFn", "ModelFn", "TorchTask", "TorchTrainer", "TrainFn"]

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]
"""What the train and evaluate code iterates over: ``(inputs, labels)`` mini-batches, on the CPU."""
ModelFn = Callable[[], torch.nn.Module]
TrainFn = Callable[[torch.nn.Module, Batches, "TorchTask"], Mapping[str, Any] | None]
EvaluateFn = Callable[[torch.nn.Module, Batches, "TorchTask"], Mapping[str, float]]


@dataclass(frozen=True, slots=True, kw_only=True)
class TorchTask:
    """What the train and evaluate code knows about the task it runs in."""

    ctx: Context
    """The task's context (task name, partition, data source, event handlers...)."""
    abort_signal: Signal
    """Call ``abort_signal.check()`` between batches: a stopping runner raises there."""
    device: torch.device
    """Where the model is; move each batch there."""
    epochs: int
    """Passes over the training data (the trainer's ``epochs`` arg)."""
    generator: torch.Generator
    """A CPU generator seeded for this task: draw any randomness of your own from it."""
    dataset_type: str
    """The dataset the batches come from (``"train"``, ``"valid"``, ``"test"``...)."""

    def report_loss(self, loss: float, epoch: int, steps: int) -> None:
        """Fires ``LOSS_GENERATED`` (``{"loss", "epoch", "iter": steps so far}``), like the numpy trainers."""
        self.ctx.fire_event(EventType.LOSS_GENERATED, {"loss": loss, "epoch": epoch, "iter": steps})


class TorchTrainer:
    """Trains (or evaluates) a PyTorch model on the device's data; the PyTorch twin of
    :class:`~fedlink.runner.executors.base.NumpyTrainer`.

    **Train** (any task name not in ``evaluate_tasks``): takes the global model from the task's
    ``WEIGHTS`` DXO, whose variables are exactly the module's ``state_dict`` entries (names, shapes;
    float16/32/64, bfloat16 and integer buffers such as BatchNorm's ``num_batches_tracked`` alike),
    loads it into the module, calls :meth:`train` on the data source's ``"train"`` dataset and returns
    a ``WEIGHT_DIFF`` DXO: trained minus global for every ``state_dict`` entry, in the entry's incoming
    dtype, with meta ``num_examples`` (the training set's size: FedAvg's weight) plus whatever
    :meth:`train` returns (the default loop: ``train_loss``, ``train_accuracy``,
    ``num_steps_current_round``), and ``val_*`` metrics of :meth:`evaluate` when the source has a
    ``"valid"`` dataset. Unsigned and bool buffers have no meaningful difference and are refused:
    register them with ``persistent=False`` to keep them out of the ``state_dict``.

    **Evaluate** (task names in ``evaluate_tasks``): no training; returns a ``METRICS`` DXO whose data
    holds :meth:`evaluate`'s metrics as 0-d float64 arrays, on the first dataset of ``eval_datasets``
    the source has (or the task meta's ``dataset_type``), with meta ``num_examples`` and
    ``dataset_type``.

    **Copies.** Loading writes the task's arrays straight into the module's parameters and buffers,
    and the difference is taken from views of them: on the CPU, no copy of the model is made besides
    the result itself (see :mod:`fedlink.runner.executors.torch.convert` for where copies do happen:
    GPU modules, bfloat16 without ``ml_dtypes``, modules with state-dict hooks).

    **Models are built once per worker.** The trainer keeps the modules it built and lends one to each
    task, building another only when every one is busy: a runner (one task at a time) builds one
    module for all its tasks and rounds, and a simulation sharing its components (the default) builds
    one per task running at once — the size of its pool — not one per virtual device. Everything in
    the ``state_dict`` is reset from the task's model, and the gradients are dropped after training;
    anything else a module keeps between calls survives from task to task. :attr:`models_built`
    counts the modules built.

    **Determinism.** Each task gets a seed from ``(seed, partition id, meta model_version)``: the
    shuffling of the batches comes from a generator seeded with it (:attr:`TorchTask.generator`),
    and ``torch.manual_seed`` is called with it before :meth:`train`. With ``deterministic`` (the
    default) ``torch.use_deterministic_algorithms(True)`` is switched on for the process (and
    ``CUBLAS_WORKSPACE_CONFIG`` set, if unset, for CUDA). Equal inputs then give equal bits, with two
    caveats: randomness drawn from PyTorch's global generator (``nn.Dropout``, random augmentations)
    is shared by every thread, so it is reproducible only while tasks run one at a time (a runner, or
    a simulation with one worker: draw from ``task.generator`` instead); and results depend on the
    number of intra-op threads (``torch.set_num_threads``), which should match between runs compared.

    **Device.** ``device="cpu"`` by default; ``"cuda"``, ``"cuda:1"``, ``"mps"``... move the module
    there when it is built, and the default loops move each batch there.
    """

    def __init__(
        self,
        epochs: int = 1,
        batch_size: int = 32,
        learning_rate: float = 0.01,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        seed: int = 0,
        device: str = "cpu",
        deterministic: bool = True,
        num_threads: int | None = None,
        data_source: DataSource | None = None,
        evaluate_tasks: Sequence[str] = DEFAULT_EVALUATE_TASKS,
        eval_datasets: Sequence[str] = ("valid", "test"),
        model_fn: ModelFn | None = None,
        train_fn: TrainFn | None = None,
        evaluate_fn: EvaluateFn | None = None,
    ) -> None:
        """Configure the trainer (the job config's ``args``; the functions come from the app).

        Args:
            epochs: Passes over the training data per task.
            batch_size: Mini-batch size (the last batch of an epoch may be smaller).
            learning_rate: The default optimizer's (SGD) learning rate.
            momentum: The default optimizer's momentum (its state starts afresh every task).
            weight_decay: The default optimizer's L2 penalty.
            seed: Seeds each task's randomness (see the class doc).
            device: A ``torch.device`` string.
            deterministic: Switch on PyTorch's deterministic algorithms (see the class doc).
            num_threads: If given, ``torch.set_num_threads(num_threads)`` for the whole process, now.
                1 suits small models in a simulation, which runs several tasks at once: PyTorch's
                intra-op threads would compete with them for the same cores.
            data_source: The data; default: the context's ``DATA_SOURCE``.
            evaluate_tasks: Task names that evaluate instead of train.
            eval_datasets: Dataset types an evaluate task looks for, in order.
            model_fn: Builds the model (instead of overriding :meth:`build_model`).
            train_fn: Replaces :meth:`train`.
            evaluate_fn: Replaces :meth:`evaluate`.

        Raises:
            InvalidArgument: A value out of range, an unknown or unavailable device, or a function
                that is not callable (the message names the arg).
        """
        self.epochs = _positive_int("epochs", epochs)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.learning_rate = _number("learning_rate", learning_rate, minimum=0.0, inclusive=False)
        self.momentum = _number("momentum", momentum, minimum=0.0, inclusive=True)
        self.weight_decay = _number("weight_decay", weight_decay, minimum=0.0, inclusive=True)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise InvalidArgument(f"seed must be an integer >= 0, got {seed!r}")
        self.seed = seed
        self.device = _device(device)
        self.deterministic = bool(deterministic)
        if num_threads is not None:
            torch.set_num_threads(_positive_int("num_threads", num_threads))
        self.num_threads = num_threads
        self.data_source = data_source
        self.evaluate_tasks = frozenset(evaluate_tasks)
        self.eval_datasets = tuple(eval_datasets)
        for name, fn in (("model_fn", model_fn), ("train_fn", train_fn), ("evaluate_fn", evaluate_fn)):
            if fn is not None and not callable(fn):
                raise InvalidArgument(f"{name} must be callable, got {fn!r}")
        self.model_fn = model_fn
        self.train_fn = train_fn
        self.evaluate_fn = evaluate_fn
        self._lock = threading.Lock()
        self._idle: list[torch.nn.Module] = []
        self._built = 0

    # -- what a user defines -------------------------------------------------------------------

    def build_model(self) -> torch.nn.Module:
        """A new module (its initial values do not matter: every task loads the global model).

        Raises:
            FailedPrecondition: Neither ``model_fn`` was given nor this method overridden.
        """
        if self.model_fn is None:
            raise FailedPrecondition(
                f"{type(self).__name__} has no model: give model_fn or override build_model()"
            )
        return self.model_fn()

    def train(self, model: torch.nn.Module, batches: Batches, task: TorchTask) -> Mapping[str, Any] | None:
        """Trains ``model`` in place on ``batches`` for ``task.epochs`` epochs; returns metrics for the
        result's meta (``train_fn`` replaces it when given).

        The default: :meth:`build_optimizer`, then for every batch ``loss(model(x), y)``, backward, step;
        the abort signal is checked before every batch and ``LOSS_GENERATED`` fired after every epoch.
        It returns ``train_loss`` (and ``train_accuracy`` for class-index labels), the mean over the
        last epoch's batches as they were trained, and ``num_steps_current_round``.

        Raises:
            InvalidArgument: The loss became NaN or infinite (the message says at which step).
        """
        if self.train_fn is not None:
            return self.train_fn(model, batches, task)
        optimizer = self.build_optimizer(model)
        model.train()
        steps = 0
        metrics: dict[str, Any] = {}
        for epoch in range(task.epochs):
            running = _Running()
            for inputs, labels in batches:
                task.abort_signal.check()
                inputs, labels = inputs.to(task.device), labels.to(task.device)
                optimizer.zero_grad(set_to_none=True)
                outputs = model(inputs)
                loss = self.loss(outputs, labels)
                value = float(loss.item())
                if not math.isfinite(value):
                    raise InvalidArgument(
                        f"training diverged (loss {value} at step {steps} of epoch {epoch}); lower "
                        f"learning_rate (now {self.learning_rate}) or scale the inputs"
                    )
                torch.autograd.backward(loss)  # loss.backward(), typed
                optimizer.step()
                running.add(value, outputs.detach(), labels)
                steps += 1
            task.report_loss(running.loss(), epoch, steps)
            metrics = running.metrics("train_")
        return {**metrics, MetaKey.NUM_STEPS_CURRENT_ROUND: steps}

    def evaluate(self, model: torch.nn.Module, batches: Batches, task: TorchTask) -> Mapping[str, float]:
        """Metrics of ``model`` on ``batches``, without training (``evaluate_fn`` replaces it when given).

        The default: ``loss`` (the mean of :meth:`loss` over the samples) and, for class-index labels
        and 2-D outputs, ``accuracy``; in ``model.eval()`` mode, without gradients.
        """
        if self.evaluate_fn is not None:
            return self.evaluate_fn(model, batches, task)
        model.eval()
        running = _Running()
        with torch.no_grad():
            for inputs, labels in batches:
                task.abort_signal.check()
                inputs, labels = inputs.to(task.device), labels.to(task.device)
                outputs = model(inputs)
                running.add(float(self.loss(outputs, labels).item()), outputs, labels)
        return running.metrics("")

    def loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean loss of a batch: cross-entropy for integer labels, mean squared error otherwise."""
        if labels.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            return torch.nn.functional.cross_entropy(outputs, labels.long())
        return torch.nn.functional.mse_loss(outputs, labels.reshape(outputs.shape))

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The default loop's optimizer, new every task: SGD with the trainer's args."""
        return torch.optim.SGD(
            model.parameters(), lr=self.learning_rate, momentum=self.momentum, weight_decay=self.weight_decay
        )

    def to_tensors(
        self, x: npt.NDArray[Any], y: npt.NDArray[Any], model: torch.nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A dataset's arrays as CPU tensors: inputs in the dtype of the model's first floating-point
        parameter, integer labels as int64, float labels in the inputs' dtype.

        Writable, native arrays of those dtypes are shared, not copied (``torch.from_numpy``); reshape
        inputs in the model's ``forward`` (or override this) when the data is stored flat.
        """
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        inputs = _host_tensor(x).to(dtype)
        labels = _host_tensor(y)
        labels = labels.long() if not labels.is_floating_point() else labels.to(dtype)
        return inputs, labels

    def batches(
        self, inputs: torch.Tensor, labels: torch.Tensor, *, shuffle: bool, generator: torch.Generator
    ) -> Batches:
        """Mini-batches of ``batch_size``: a ``DataLoader`` over the tensors (shuffled by ``generator``
        for training, in order for evaluation), indexing a whole batch at once."""
        dataset = TensorDataset(inputs, labels)
        sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
        # batch_size=None: each BatchSampler item (a list of indices) is one dataset lookup, a batch.
        return DataLoader(
            dataset, sampler=BatchSampler(sampler, self.batch_size, drop_last=False), batch_size=None
        )

    # -- the executor ---------------------------------------------------------------------------

    @property
    def models_built(self) -> int:
        """How many modules this trainer has built so far."""
        with self._lock:
            return self._built

    def execute(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """Train on, or evaluate, the task's model depending on the task name (see the class doc)."""
        task_name = str(ctx.get(ContextKey.TASK_NAME, "train"))
        if task_name in self.evaluate_tasks:
            return self.run_evaluate_task(dxo, ctx, abort_signal)
        return self.run_train_task(dxo, ctx, abort_signal)

    def run_train_task(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """Train the task's global model locally and return the ``WEIGHT_DIFF`` (see the class doc)."""
        abort_signal.check()
        incoming = self._read_model(dxo)
        source = self._source(ctx)
        x, y = source.get_dataset("train", ctx).arrays()
        if len(x) == 0:
            raise FailedPrecondition("the 'train' dataset is empty; there is nothing to train on")
        with self._lend_model() as model:
            load_arrays(model, incoming)
            task = self._task(ctx, dxo, abort_signal, "train")
            inputs, labels = self.to_tensors(x, y, model)
            outcome = self.train(
                model, self.batches(inputs, labels, shuffle=True, generator=task.generator), task
            )
            # The gradients belong to this task's model: dropped now rather than kept by the idle
            # module (a model's worth of memory per module between tasks; the difference reuses it).
            model.zero_grad(set_to_none=True)
            diff = _difference(model, incoming)
            meta: dict[str, MetaValue] = {MetaKey.NUM_EXAMPLES: len(x)}
            meta.update(_meta_values(outcome or {}))
            try:
                x_val, y_val = source.get_dataset("valid", ctx).arrays()
            except NotFound:
                pass
            else:
                if len(x_val):
                    metrics = self._evaluate_on(model, x_val, y_val, ctx, dxo, abort_signal, "valid")
                    meta.update({f"val_{key}": value for key, value in metrics.items()})
        return DXO(kind=DataKind.WEIGHT_DIFF, data=diff, meta=meta)

    def run_evaluate_task(self, dxo: DXO, ctx: Context, abort_signal: Signal) -> DXO:
        """Evaluate the task's model without training; return a ``METRICS`` DXO (see the class doc)."""
        abort_signal.check()
        incoming = self._read_model(dxo)
        source = self._source(ctx)
        requested = dxo.get_meta_prop("dataset_type")
        candidates = (str(requested),) if isinstance(requested, str) else self.eval_datasets
        for dataset_type in candidates:
            try:
                x, y = source.get_dataset(dataset_type, ctx).arrays()
            except NotFound:
                continue
            if len(x) == 0:
                continue
            with self._lend_model() as model:
                load_arrays(model, incoming)
                metrics = self._evaluate_on(model, x, y, ctx, dxo, abort_signal, dataset_type)
            data = {key: np.asarray(value, dtype=np.float64) for key, value in metrics.items()}
            meta: dict[str, MetaValue] = {MetaKey.NUM_EXAMPLES: len(x), "dataset_type": dataset_type}
            return DXO(kind=DataKind.METRICS, data=data, meta=meta)
        raise FailedPrecondition(f"the data source has no non-empty dataset among {list(candidates)}")

    # -- helpers --------------------------------------------------------------------------------

    def _evaluate_on(
        self,
        model: torch.nn.Module,
        x: npt.NDArray[Any],
        y: npt.NDArray[Any],
        ctx: Context,
        dxo: DXO,
        abort_signal: Signal,
        dataset_type: str,
    ) -> dict[str, float]:
        task = self._task(ctx, dxo, abort_signal, dataset_type)
        inputs, labels = self.to_tensors(x, y, model)
        batches = self.batches(inputs, labels, shuffle=False, generator=task.generator)
        metrics = self.evaluate(model, batches, task)
        return {str(key): float(value) for key, value in metrics.items()}

    def _task(self, ctx: Context, dxo: DXO, abort_signal: Signal, dataset_type: str) -> TorchTask:
        seed = int(
            np.random.SeedSequence([self.seed, _partition_id(ctx), _model_version(dxo)]).generate_state(
                1, np.uint64
            )[0]
        )
        if self.deterministic:
            _deterministic(self.device)
        torch.manual_seed(seed)  # for code that draws from the global generator (see the class doc)
        return TorchTask(
            ctx=ctx,
            abort_signal=abort_signal,
            device=self.device,
            epochs=self.epochs,
            generator=torch.Generator().manual_seed(seed),
            dataset_type=dataset_type,
        )

    @contextlib.contextmanager
    def _lend_model(self) -> Iterator[torch.nn.Module]:
        with self._lock:
            model = self._idle.pop() if self._idle else None
        if model is None:
            model = self._new_model()
        try:
            yield model
        finally:
            with self._lock:
                self._idle.append(model)

    def _new_model(self) -> torch.nn.Module:
        model = self.build_model()
        if not isinstance(model, torch.nn.Module):
            raise InvalidArgument(
                f"{type(self).__name__}: the model must be a torch.nn.Module, not {type(model).__name__}"
            )
        model.to(self.device)
        with self._lock:
            self._built += 1
        return model

    def _read_model(self, dxo: DXO) -> dict[str, npt.NDArray[Any]]:
        if dxo.kind != DataKind.WEIGHTS:
            raise InvalidArgument(
                f"{type(self).__name__} needs a WEIGHTS DXO with the global model, got {dxo.kind}"
            )
        return dxo.data

    def _source(self, ctx: Context) -> DataSource:
        if self.data_source is not None:
            return self.data_source
        source: DataSource = ctx.data_source()
        return source

    def __getstate__(self) -> dict[str, Any]:
        # Picklable (the ray backend ships executors): without the lock and the built modules.
        state = dict(self.__dict__)
        for key in ("_lock", "_idle", "_built"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.num_threads is not None:  # a process of its own: apply it there too
            torch.set_num_threads(self.num_threads)
        self._lock = threading.Lock()
        self._idle = []
        self._built = 0


class _Running:
    """Sums of a pass over batches: loss weighted by batch size, and correct predictions."""

    def __init__(self) -> None:
        self.count = 0
        self.total_loss = 0.0
        self.correct = 0
        self.classified = True

    def add(self, loss: float, outputs: torch.Tensor, labels: torch.Tensor) -> None:
        n = len(labels)
        self.count += n
        self.total_loss += loss * n
        if self.classified and outputs.ndim == 2 and not labels.is_floating_point():
            self.correct += int((outputs.argmax(dim=1) == labels).sum().item())
        else:
            self.classified = False

    def loss(self) -> float:
        return self.total_loss / self.count if self.count else math.nan

    def metrics(self, prefix: str) -> dict[str, float]:
        result = {f"{prefix}loss": self.loss()}
        if self.classified and self.count:
            result[f"{prefix}accuracy"] = self.correct / self.count
        return result


def _device(device: str) -> torch.device:
    try:
        result = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgument(
            f"device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}: {exc}"
        ) from None
    if result.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(
            f"device {device!r}: CUDA is not available here (torch.cuda.is_available() is False)"
        )
    if result.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidArgument(f"device {device!r}: MPS is not available here")
    return result


def _deterministic(device: torch.device) -> None:
    if device.type == "cuda":
        # cuBLAS needs this before its first use to be deterministic (PyTorch raises without it).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    if not torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(True)


def _host_tensor(array: npt.NDArray[Any]) -> torch.Tensor:
    array = np.asarray(array)
    if not array.dtype.isnative or not array.flags.writeable or any(s < 0 for s in array.strides):
        array = np.array(array, dtype=array.dtype.newbyteorder("="))  # torch shares only writable memory
    return torch.from_numpy(array)


def _difference(
    model: torch.nn.Module, incoming: Mapping[str, npt.NDArray[Any]]
) -> dict[str, npt.NDArray[Any]]:
    diff: dict[str, npt.NDArray[Any]] = {}
    for name, tensor in model.state_dict().items():
        base = incoming[name]
        if base.dtype.kind in "bu":
            raise InvalidArgument(
                f"state_dict entry {name!r} is {base.dtype}, which has no meaningful difference; register "
                "it with persistent=False (or keep it as a float or signed integer tensor)"
            )
        # asarray: numpy gives a scalar, not an array, for 0-d operands (num_batches_tracked is 0-d).
        diff[name] = np.asarray(np.subtract(tensor_to_array(name, tensor), base, dtype=base.dtype))
    return diff


def _meta_values(outcome: Mapping[str, Any]) -> dict[str, MetaValue]:
    meta: dict[str, MetaValue] = {}
    for key, value in outcome.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise InvalidArgument(
                    f"train returned a tensor of {value.numel()} elements as {key!r}; return numbers"
                )
            value = value.item()
        meta[str(key)] = value
    return meta
