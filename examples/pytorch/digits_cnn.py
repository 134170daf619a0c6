"""The PyTorch example's model and data: a small CNN on scikit-learn's 8x8 digits.

``job.toml`` names the trainer ``digits_cnn:DigitsCNNTrainer``: this module's class, by import path.
``fedlink simulate`` imports it (the job file's folder is on its module path); ``fedlink runner``
imports it with this folder on ``PYTHONPATH`` and ``--allow-components digits_cnn``.
``python examples/pytorch/digits_cnn.py`` rewrites ``initial.npz``, the job's initial model (the CNN's
seeded initialisation); with ``--data PATH`` it also writes the digits as the ``.npz`` that
``fedlink runner --data`` and ``fedlink simulate --data`` read (``job.toml``'s ``[simulation]`` looks
for ``digits.npz`` beside it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from fedlink.runner.data import ArrayDataSource
from fedlink.runner.data.partition import all_partitions
from fedlink.runner.executors.torch import TorchTrainer, load_arrays, state_dict_to_arrays

__all__ = [
    "TRAINER_TYPE",
    "Digits",
    "DigitsCNN",
    "DigitsCNNTrainer",
    "accuracy",
    "initial_model",
]

#: The trainer's type in ``job.toml``: the import path it is loaded by.
TRAINER_TYPE = "digits_cnn:DigitsCNNTrainer"
HERE = Path(__file__).resolve().parent


class DigitsCNN(torch.nn.Module):
    """Two 3x3 convolutions (16 and 32 channels), a 2x2 max-pool, a 64-unit hidden layer: 38,282
    parameters. Takes the digits as they are stored, 64 values per sample, and sees them as 1x8x8."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the 10 digits for a batch of (samples, 64) or (samples, 1, 8, 8) inputs."""
        x = x.reshape(-1, 1, 8, 8)
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        x = torch.relu(self.fc1(x.flatten(1)))
        logits: torch.Tensor = self.fc2(x)
        return logits


class DigitsCNNTrainer(TorchTrainer):
    """The runner's trainer for :class:`DigitsCNN`: the default supervised loop (SGD, cross-entropy)."""

    def build_model(self) -> torch.nn.Module:
        """A new, untrained CNN (each task loads the global model into it)."""
        return DigitsCNN()


def initial_model(seed: int = 0) -> dict[str, npt.NDArray[Any]]:
    """The CNN's default (Kaiming-uniform) initialisation drawn from ``seed``, as named arrays."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = DigitsCNN()
    return {name: np.array(array) for name, array in state_dict_to_arrays(model.state_dict()).items()}


@dataclass(frozen=True, slots=True)
class Digits:
    """The digits scaled to [0, 1], with 25% held out (stratified, ``random_state=0``): the split of
    the quickstart and of ``tests/simulation/conftest.py``."""

    x_train: npt.NDArray[np.float32]
    y_train: npt.NDArray[np.int64]
    x_test: npt.NDArray[np.float32]
    y_test: npt.NDArray[np.int64]

    @classmethod
    def load(cls) -> Digits:
        """Loads the 1,797 images bundled with scikit-learn (nothing is downloaded) and splits them."""
        # Imported here: a device process needs the model, not scikit-learn (a second to import).
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x_train, x_test, y_train, y_test = train_test_split(
            (x / 16.0).astype(np.float32), y.astype(np.int64), test_size=0.25, stratify=y, random_state=0
        )
        return cls(x_train, y_train, x_test, y_test)

    def source(self) -> ArrayDataSource:
        """Every device's data before partitioning: ``"train"`` and the held-out ``"test"``."""
        return ArrayDataSource({"train": (self.x_train, self.y_train), "test": (self.x_test, self.y_test)})

    def save(self, path: Path) -> None:
        """Writes the ``.npz`` a runner reads (``x_train``, ``y_train``, ``x_test``, ``y_test``)."""
        with path.open("wb") as file:
            np.savez(file, x_train=self.x_train, y_train=self.y_train, x_test=self.x_test, y_test=self.y_test)

    def partition_sizes(self, devices: int, *, alpha: float, seed: int) -> list[int]:
        """How many training samples each device gets (Dirichlet label skew, as the runners split it)."""
        return [
            len(p) for p in all_partitions(self.y_train, devices, method="dirichlet", alpha=alpha, seed=seed)
        ]


def accuracy(
    arrays: dict[str, npt.NDArray[Any]], x: npt.NDArray[np.float32], y: npt.NDArray[np.int64]
) -> float:
    """Top-1 accuracy of a :class:`DigitsCNN` holding ``arrays`` on ``(x, y)``."""
    model = DigitsCNN()
    load_arrays(model, arrays)
    model.eval()
    with torch.no_grad():
        predicted = model(torch.from_numpy(np.ascontiguousarray(x))).argmax(dim=1).numpy()
    return float(np.mean(predicted == y))


def main() -> None:
    """Writes the job's initial model (``initial.npz`` beside this file), and the data file on request."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--initial", type=Path, default=HERE / "initial.npz", help="where the model goes")
    parser.add_argument("--data", type=Path, help="also write the digits here, as a runner's --data file")
    args = parser.parse_args()
    with args.initial.open("wb") as file:
        np.savez(file, allow_pickle=False, **initial_model())
    print(f"wrote {args.initial}")
    if args.data is not None:
        Digits.load().save(args.data)
        print(f"wrote {args.data} (x_train, y_train, x_test, y_test)")


if __name__ == "__main__":
    main()
