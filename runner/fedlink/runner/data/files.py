"""Data sources that read files: numpy ``.npz`` archives and CSV tables."""

from __future__ import annotations

import csv
import os
import zipfile
from typing import Any

import numpy as np
import numpy.typing as npt

from fedlink.common.errors import InvalidArgument, NotFound
from fedlink.runner.data.arrays import ArrayDataSource

__all__ = ["CsvDataSource", "NpzDataSource"]


class NpzDataSource(ArrayDataSource):
    """Serves the pairs ``x_<type>``/``y_<type>`` of a ``.npz`` file (e.g. ``x_train``, ``y_train``).

    The file is read once, when the source is built; pickled objects are refused. Keys without a
    partner (``x_test`` without ``y_test``) are an error; other keys are ignored.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Load the archive.

        Raises:
            NotFound: The file does not exist.
            InvalidArgument: Not a readable ``.npz``, no ``x_*``/``y_*`` pair, or an unpaired key.
        """
        self.path = os.fspath(path)
        try:
            with np.load(self.path, allow_pickle=False) as archive:
                arrays = {key: archive[key] for key in archive.files}
        except FileNotFoundError:
            raise NotFound(f"no such .npz file: {self.path}") from None
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise InvalidArgument(f"cannot read {self.path} as an .npz archive: {exc}") from None
        types = {key[2:] for key in arrays if key.startswith(("x_", "y_"))}
        unpaired = sorted(t for t in types if f"x_{t}" not in arrays or f"y_{t}" not in arrays)
        if unpaired:
            raise InvalidArgument(f"{self.path}: x_/y_ arrays without a partner for {unpaired}")
        if not types:
            raise InvalidArgument(f"{self.path} has no x_<type>/y_<type> arrays (keys: {sorted(arrays)})")
        super().__init__({t: (arrays[f"x_{t}"], arrays[f"y_{t}"]) for t in sorted(types)})


class CsvDataSource(ArrayDataSource):
    """Serves numeric CSV files, one per dataset type, with one column as the label.

    Every column but the label is a float32 feature. The label column is chosen by header name or by
    index (negative counts from the end; the default -1 is the last column). Labels become int64 when
    every value is a whole number (class indices), else float32. Files are read when the source is
    built.
    """

    def __init__(
        self,
        train: str | None = None,
        valid: str | None = None,
        test: str | None = None,
        label_column: str | int = -1,
        header: bool = True,
        delimiter: str = ",",
    ) -> None:
        """Read the given files (at least one).

        Raises:
            NotFound: A file does not exist.
            InvalidArgument: No file given, a label column that is not there, a non-numeric or
                missing value, or rows of different lengths (the message names file and line).
        """
        paths = {name: p for name, p in (("train", train), ("valid", valid), ("test", test)) if p}
        if not paths:
            raise InvalidArgument("CsvDataSource needs at least one of train, valid, test")
        if label_column is None or isinstance(label_column, bool):
            raise InvalidArgument(f"label_column must be a column name or index, got {label_column!r}")
        self.label_column = label_column
        self.header = header
        self.delimiter = delimiter
        super().__init__({name: self._read(path) for name, path in paths.items()})

    def _read(self, path: str) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
        try:
            with open(path, newline="") as handle:
                rows = list(csv.reader(handle, delimiter=self.delimiter))
        except FileNotFoundError:
            raise NotFound(f"no such CSV file: {path}") from None
        except (OSError, UnicodeDecodeError, csv.Error) as exc:
            raise InvalidArgument(f"cannot read {path} as CSV: {exc}") from None
        names = rows.pop(0) if self.header and rows else []
        rows = [row for row in rows if row]  # a trailing newline gives an empty row
        if not rows:
            raise InvalidArgument(f"{path} has no data rows")
        width = len(rows[0])
        label = self._label_index(path, names, width)
        values = np.empty((len(rows), width), dtype=np.float64)
        first_line = 2 if self.header else 1
        for i, row in enumerate(rows):
            if len(row) != width:
                raise InvalidArgument(f"{path} line {i + first_line}: {len(row)} columns, expected {width}")
            try:
                values[i] = [float(cell) for cell in row]
            except ValueError as exc:
                raise InvalidArgument(f"{path} line {i + first_line}: {exc}") from None
        if not np.all(np.isfinite(values)):
            raise InvalidArgument(f"{path} has missing (NaN) or infinite values")
        y = values[:, label]
        x = np.delete(values, label, axis=1).astype(np.float32)
        labels = y.astype(np.int64) if np.all(y == np.round(y)) else y.astype(np.float32)
        return x, labels

    def _label_index(self, path: str, names: list[str], width: int) -> int:
        if isinstance(self.label_column, str):
            if self.label_column not in names:
                raise InvalidArgument(f"{path}: no label column {self.label_column!r} in header {names}")
            return names.index(self.label_column)
        if not -width <= self.label_column < width:
            raise InvalidArgument(
                f"{path}: label column {self.label_column} is out of range ({width} columns)"
            )
        return self.label_column % width
