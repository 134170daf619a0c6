"""Fixtures for the runner tests: a small real dataset (scikit-learn's digits) and task contexts."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from fedlink.runner.data import ArrayDataSource

Split = tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]]


@pytest.fixture(scope="session")
def digits() -> Split:
    """8x8 digit images scaled to [0, 1] as float32, split 75/25 (stratified, fixed seed)."""
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        (x / 16.0).astype(np.float32), y, test_size=0.25, random_state=0, stratify=y
    )
    return x_train, x_test, y_train, y_test


@pytest.fixture(scope="session")
def digits_source(digits: Split) -> ArrayDataSource:
    """The digits as a data source with "train" and "test" datasets."""
    x_train, x_test, y_train, y_test = digits
    return ArrayDataSource({"train": (x_train, y_train), "test": (x_test, y_test)})
