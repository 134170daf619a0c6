"""Tests of the built-in data sources and of IID / Dirichlet partitioning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from fedlink.common.errors import FailedPrecondition, InvalidArgument, NotFound
from fedlink.runner import ArrayDataset, Context, ContextKey
from fedlink.runner.data import (
    ArrayDataSource,
    CsvDataSource,
    NpzDataSource,
    PartitionedDataSource,
    all_partitions,
    partition_indices,
)


def _labels(n: int = 2000, classes: int = 10, seed: int = 0) -> npt.NDArray[np.int64]:
    return np.random.default_rng(seed).integers(0, classes, n)


def _assert_disjoint_cover(parts: list[npt.NDArray[np.int64]], n: int) -> None:
    joined = np.concatenate(parts)
    assert len(joined) == n, "some sample is missing or in two partitions"
    np.testing.assert_array_equal(np.sort(joined), np.arange(n))
    assert all(len(p) > 0 for p in parts), [len(p) for p in parts]
    assert all(np.all(np.diff(p) > 0) for p in parts), "partitions are sorted"


def test_iid_partitions_cover_every_sample_once_with_balanced_sizes() -> None:
    parts = all_partitions(_labels(1003), 10, seed=1)
    _assert_disjoint_cover(parts, 1003)
    assert {len(p) for p in parts} == {100, 101}


def test_each_device_computes_its_own_partition_consistently() -> None:
    labels = _labels()
    for method in ("iid", "dirichlet"):
        own = [partition_indices(labels, 7, i, method=method, seed=3) for i in range(7)]
        _assert_disjoint_cover(own, len(labels))
        for mine, whole in zip(own, all_partitions(labels, 7, method=method, seed=3), strict=True):
            np.testing.assert_array_equal(mine, whole)


def test_partitioning_is_seeded() -> None:
    labels = _labels()
    for method in ("iid", "dirichlet"):
        a = all_partitions(labels, 5, method=method, seed=1)
        b = all_partitions(labels, 5, method=method, seed=1)
        c = all_partitions(labels, 5, method=method, seed=2)
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
        assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def _mean_label_skew(labels: npt.NDArray[np.int64], parts: list[npt.NDArray[np.int64]]) -> float:
    """Mean total-variation distance between each partition's label distribution and the global one."""
    overall = np.bincount(labels, minlength=10) / len(labels)
    return float(
        np.mean([0.5 * np.abs(np.bincount(labels[p], minlength=10) / len(p) - overall).sum() for p in parts])
    )


def test_dirichlet_skews_label_distributions_and_alpha_controls_how_much() -> None:
    labels = _labels(5000)
    skewed = all_partitions(labels, 10, method="dirichlet", alpha=0.1, seed=0)
    mild = all_partitions(labels, 10, method="dirichlet", alpha=1000.0, seed=0)
    iid = all_partitions(labels, 10, seed=0)
    for parts in (skewed, mild):
        _assert_disjoint_cover(parts, len(labels))
    assert _mean_label_skew(labels, skewed) > 0.4
    assert _mean_label_skew(labels, mild) < 0.08
    assert _mean_label_skew(labels, iid) < 0.08
    dominant = {int(np.argmax(np.bincount(labels[p], minlength=10))) for p in skewed}
    assert len(dominant) > 3, "partitions should be dominated by different classes"


def test_dirichlet_never_leaves_a_partition_empty_even_at_the_limit() -> None:
    # As many samples as partitions and a tiny alpha: only the repair step can make this work.
    labels = np.array([0, 0, 0, 1, 1, 1, 2, 2])
    for seed in range(20):
        parts = all_partitions(labels, 8, method="dirichlet", alpha=0.01, seed=seed)
        _assert_disjoint_cover(parts, 8)
        assert all(len(p) == 1 for p in parts)


def test_string_labels_work_for_dirichlet() -> None:
    labels = np.array(["cat", "dog", "bird"] * 50)
    _assert_disjoint_cover(all_partitions(labels, 6, method="dirichlet", alpha=0.5), 150)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"labels": np.arange(3), "num_partitions": 4, "partition_id": 0}, "cannot split 3 samples into 4"),
        (
            {"labels": np.arange(9), "num_partitions": 3, "partition_id": 3},
            r"partition_id must be in \[0, 3\)",
        ),
        ({"labels": np.arange(9), "num_partitions": 0, "partition_id": 0}, "partition_id must be in"),
        ({"labels": np.arange(9), "num_partitions": 3, "partition_id": 0, "method": "zipf"}, "'zipf'"),
        (
            {
                "labels": np.arange(9),
                "num_partitions": 3,
                "partition_id": 0,
                "method": "dirichlet",
                "alpha": 0,
            },
            "alpha",
        ),
        (
            {"labels": np.zeros((9, 2)), "num_partitions": 3, "partition_id": 0, "method": "dirichlet"},
            "1-D class labels",
        ),
    ],
)
def test_partition_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        partition_indices(**kwargs)


def _source(n: int = 100) -> ArrayDataSource:
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    y = np.arange(n) % 4
    return ArrayDataSource({"train": (x, y), "test": (x[:10], y[:10])})


def test_partitioned_source_takes_the_partition_from_the_context() -> None:
    wrapped = PartitionedDataSource(_source(), method="dirichlet", alpha=1.0, seed=5)
    seen: list[npt.NDArray[Any]] = []
    for index in range(4):
        ctx = Context({ContextKey.PARTITION_ID: index, ContextKey.NUM_PARTITIONS: 4})
        x, y = wrapped.get_dataset("train", ctx).arrays()
        np.testing.assert_array_equal(y, (x[:, 0] / 2).astype(int) % 4)  # rows stay paired with labels
        seen.append(x[:, 0])
        assert wrapped.get_dataset("test", ctx).size() == 10  # test data is not partitioned
        assert wrapped.get_dataset("train", ctx) is wrapped.get_dataset("train", ctx)  # cached
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(0, 200, 2))


def test_partitioned_source_args_win_over_the_context_and_are_required() -> None:
    by_args = PartitionedDataSource(_source(), num_partitions=3, partition_id=2)
    ctx = Context({ContextKey.PARTITION_ID: 0, ContextKey.NUM_PARTITIONS: 10})
    expected = partition_indices(np.arange(100) % 4, 3, 2)
    np.testing.assert_array_equal(by_args.get_dataset("train", ctx).arrays()[0][:, 0], expected * 2)
    with pytest.raises(FailedPrecondition, match="'num_partitions'"):
        PartitionedDataSource(_source()).get_dataset("train", Context())
    with pytest.raises(NotFound, match="'valid'"):
        PartitionedDataSource(_source(), num_partitions=2, partition_id=0).get_dataset("valid", Context())


def test_array_source_errors() -> None:
    with pytest.raises(NotFound, match=r"no 'valid' dataset; this source has \['train', 'test'\]"):
        _source().get_dataset("valid", Context())
    with pytest.raises(InvalidArgument, match="train: x has 3 samples but y has 2"):
        ArrayDataSource({"train": (np.zeros((3, 2)), np.zeros(2))})


def test_dataset_reads_sequential_batches() -> None:
    dataset = ArrayDataset(np.arange(5), np.arange(5) * 10)
    first = dataset.get_next_batch(3)
    second = dataset.get_next_batch(3)
    assert first is not None and second is not None
    np.testing.assert_array_equal(first.get_input(), [0, 1, 2])
    np.testing.assert_array_equal(second.get_label(), [30, 40])
    assert dataset.get_next_batch(3) is None
    dataset.reset()
    again = dataset.get_next_batch(1)
    assert again is not None and again.get_input().tolist() == [0]


def test_npz_source_serves_every_pair(tmp_path: Path) -> None:
    path = tmp_path / "data.npz"
    np.savez(path, x_train=np.ones((4, 3)), y_train=np.arange(4), x_test=np.zeros((2, 3)), y_test=[1, 0])
    source = NpzDataSource(str(path))
    assert source.dataset_types == ("test", "train")
    x, y = source.get_dataset("train", Context()).arrays()
    assert x.shape == (4, 3) and y.tolist() == [0, 1, 2, 3]


def test_npz_source_errors(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match=r"missing\.npz"):
        NpzDataSource(tmp_path / "missing.npz")
    unpaired = tmp_path / "unpaired.npz"
    np.savez(unpaired, x_train=np.ones((2, 2)), y_train=[0, 1], x_test=np.ones((2, 2)))
    with pytest.raises(InvalidArgument, match=r"without a partner for \['test'\]"):
        NpzDataSource(unpaired)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip")
    with pytest.raises(InvalidArgument, match="cannot read"):
        NpzDataSource(garbage)


def test_csv_source_by_label_name_and_index(tmp_path: Path) -> None:
    train = tmp_path / "train.csv"
    train.write_text("a,label,b\n1.5,0,2\n3,1,4\n5,2,6\n")
    by_name = CsvDataSource(train=str(train), label_column="label")
    x, y = by_name.get_dataset("train", Context()).arrays()
    np.testing.assert_array_equal(x, [[1.5, 2], [3, 4], [5, 6]])
    assert x.dtype == np.float32 and y.dtype == np.int64 and y.tolist() == [0, 1, 2]
    x, y = CsvDataSource(train=str(train), label_column=0).get_dataset("train", Context()).arrays()
    assert y.dtype == np.float32 and y.tolist() == [1.5, 3, 5]
    no_header = tmp_path / "plain.csv"
    no_header.write_text("1;2;0\n3;4;1\n")
    x, y = (
        CsvDataSource(test=str(no_header), header=False, delimiter=";")
        .get_dataset("test", Context())
        .arrays()
    )
    assert x.shape == (2, 2) and y.tolist() == [0, 1]


def test_csv_source_errors_name_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n3,x\n")
    with pytest.raises(InvalidArgument, match=r"bad\.csv line 3"):
        CsvDataSource(train=str(bad))
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("a,b\n1,2\n3\n")
    with pytest.raises(InvalidArgument, match=r"ragged\.csv line 3: 1 columns, expected 2"):
        CsvDataSource(train=str(ragged))
    with pytest.raises(InvalidArgument, match="no label column 'y'"):
        CsvDataSource(train=str(ragged), label_column="y")
    with pytest.raises(NotFound, match=r"nope\.csv"):
        CsvDataSource(train=str(tmp_path / "nope.csv"))
    with pytest.raises(InvalidArgument, match="at least one of train, valid, test"):
        CsvDataSource()
