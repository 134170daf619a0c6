"""DXO.nbytes: the tensor bytes of a DXO and its items."""

from __future__ import annotations

import numpy as np

from fedlink.common.dxo import DXO, DataKind


def test_nbytes_counts_the_tensors_of_the_dxo_and_its_items() -> None:
    inner = DXO(kind=DataKind.WEIGHTS, data={"w": np.zeros(10, np.float32), "b": np.zeros(3, np.float64)})
    outer = DXO(kind=DataKind.COLLECTION, items={"a": inner, "b": DXO(kind=DataKind.METRICS, meta={"x": 1})})
    assert inner.nbytes() == 40 + 24
    assert outer.nbytes() == 64
    assert len(inner.to_bytes()) > inner.nbytes()  # the wire form adds only names, dtypes and shapes
