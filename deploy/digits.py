"""Writes the digits data of the compose stack's runners: ``python deploy/digits.py OUT.npz``.

The quickstart's federated split (examples/quickstart/run.py, ``federated_digits``): scikit-learn's
bundled 8x8 digits scaled to [0, 1], the stratified 75% as ``x_train``/``y_train`` (the held-out 25%,
seed 0, stays out). Every runner reads the same file and trains on its own partition of it
(``--partition-id I --num-partitions 3 --partition dirichlet --partition-alpha 0.5 --partition-seed 0``).
Needs numpy and scikit-learn only; compose's ``digits-data`` service runs it in a plain Python image.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def write_digits(out: Path, seed: int = 0) -> int:
    """Writes the federated 75% of the digits to ``out``; returns how many samples it holds."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int64)
    x_fed, _, y_fed, _ = train_test_split(x, y, test_size=0.25, stratify=y, random_state=seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as file:
        np.savez(file, x_train=x_fed, y_train=y_fed)
    return len(y_fed)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python deploy/digits.py OUT.npz")
    print(f"wrote {write_digits(Path(sys.argv[1]))} samples to {sys.argv[1]}")
