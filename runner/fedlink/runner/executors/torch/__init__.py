"""PyTorch support for the runner (the ``fedlink[torch]`` extra): a trainer and ``state_dict`` <-> DXO.

Importing this package imports ``torch``; nothing else in :mod:`fedlink.runner` does, so the base
runner install stays small. See ``docs/pytorch.md`` for a walk-through.
"""

from fedlink.runner.executors.torch.convert import (
    arrays_to_state_dict,
    load_arrays,
    state_dict_to_arrays,
    tensor_to_array,
)
from fedlink.runner.executors.torch.trainer import (
    Batches,
    EvaluateFn,
    ModelFn,
    TorchTask,
    TorchTrainer,
    TrainFn,
)

__all__ = [
    "Batches",
    "EvaluateFn",
    "ModelFn",
    "TorchTask",
    "TorchTrainer",
    "TrainFn",
    "arrays_to_state_dict",
    "load_arrays",
    "state_dict_to_arrays",
    "tensor_to_array",
]
