"""``state_dict`` <-> DXO arrays: names and dtypes kept, memory shared where promised, copies elsewhere.

Without torch these tests skip loudly; in CI (``CI`` set) torch must be there (``.ci/test`` installs
the CPU build).
"""

from __future__ import annotations

import importlib.util
import os
from collections import OrderedDict
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

if os.environ.get("CI") and importlib.util.find_spec("torch") is None:
    pytest.fail("torch is not installed in CI: .ci/test must install the CPU build", pytrace=False)
pytest.importorskip("torch", reason="the PyTorch trainer needs torch: pip install 'fedlink[torch]'")

import torch

from fedlink.common import dtypes
from fedlink.common.dxo import DXO, DataKind
from fedlink.common.errors import InvalidArgument
from fedlink.runner.executors.torch import (
    arrays_to_state_dict,
    load_arrays,
    state_dict_to_arrays,
)

BF16 = dtypes.BFLOAT16


class Mixed(torch.nn.Module):
    """Every kind of entry a state_dict holds: float32 parameters, BatchNorm's buffers (float32 and the
    int64 num_batches_tracked), a float64 and a float16 buffer, a bfloat16 parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.bn = torch.nn.BatchNorm1d(3)
        self.register_buffer("scale64", torch.linspace(0, 1, 5, dtype=torch.float64))
        self.register_buffer("halves", torch.full((2, 2), 0.5, dtype=torch.float16))
        self.bf16 = torch.nn.Parameter(torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))


def _mixed(seed: int = 0) -> Mixed:
    torch.manual_seed(seed)
    model = Mixed()
    assert model.bn.num_batches_tracked is not None
    model.bn.num_batches_tracked.fill_(7)
    return model


def _expected_numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    if dtype == torch.bfloat16:
        assert BF16 is not None
        return BF16
    return torch.empty(0, dtype=dtype).numpy().dtype


def _memory(tensor: torch.Tensor) -> npt.NDArray[Any]:
    """A numpy view of a CPU tensor's memory, whatever its dtype (bfloat16 as int16)."""
    return (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).detach().numpy()


def test_state_dict_to_arrays_keeps_names_order_dtypes_and_shares_memory() -> None:
    assert BF16 is not None, "the dev environment has ml_dtypes (fedlink[bfloat16])"
    model = _mixed()
    state = model.state_dict()
    arrays = state_dict_to_arrays(state)
    assert list(arrays) == list(state)  # names, in order, including bn.num_batches_tracked
    for name, tensor in state.items():
        array = arrays[name]
        assert array.dtype == _expected_numpy_dtype(tensor.dtype), name
        assert array.shape == tuple(tensor.shape), name
        assert np.shares_memory(array, _memory(tensor)), f"{name} was copied"
    assert arrays["bn.num_batches_tracked"].dtype == np.int64 and arrays["bn.num_batches_tracked"] == 7
    assert arrays["scale64"].dtype == np.float64 and arrays["halves"].dtype == np.float16
    # A view, not a snapshot: the arrays follow the model.
    with torch.no_grad():
        model.fc.bias.add_(1.0)
    np.testing.assert_array_equal(arrays["fc.bias"], model.fc.bias.detach().numpy())


def test_a_non_contiguous_tensor_is_a_strided_view_until_it_is_encoded() -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    transposed = base.t()
    assert not transposed.is_contiguous()
    arrays = state_dict_to_arrays({"t": transposed})
    assert np.shares_memory(arrays["t"], base.numpy())
    decoded = DXO.from_bytes(DXO(kind=DataKind.WEIGHTS, data=arrays).to_bytes())
    np.testing.assert_array_equal(decoded.data["t"], transposed.numpy())


def test_a_wire_round_trip_restores_every_entry_bit_for_bit() -> None:
    source, target = _mixed(seed=1), _mixed(seed=2)
    wire = DXO(kind=DataKind.WEIGHTS, data=state_dict_to_arrays(source.state_dict())).to_bytes()
    decoded = DXO.from_bytes(wire)
    assert all(not a.flags.writeable for a in decoded.data.values())  # views of the message bytes
    load_arrays(target, decoded.data)
    for name, tensor in source.state_dict().items():
        loaded = target.state_dict()[name]
        assert loaded.dtype == tensor.dtype, name
        assert torch.equal(loaded, tensor), name


def test_load_arrays_writes_into_the_modules_own_memory() -> None:
    model = _mixed()
    pointers = {name: t.data_ptr() for name, t in model.state_dict().items()}
    fresh = {name: np.array(a) for name, a in state_dict_to_arrays(_mixed(seed=3).state_dict()).items()}
    read_only = {}
    for name, array in fresh.items():
        array.flags.writeable = False  # as every array the simulation or the wire hands out
        read_only[name] = array
    load_arrays(model, read_only)
    for name, tensor in model.state_dict().items():
        assert tensor.data_ptr() == pointers[name], f"{name} was replaced, not written into"
        np.testing.assert_array_equal(state_dict_to_arrays({name: tensor})[name], fresh[name])


def test_load_arrays_casts_within_a_kind_and_refuses_the_rest() -> None:
    model = torch.nn.Linear(2, 2)
    arrays = {
        name: np.array(a, dtype=np.float64) for name, a in state_dict_to_arrays(model.state_dict()).items()
    }
    arrays["bias"][:] = [0.25, -0.5]
    load_arrays(model, arrays)
    assert model.bias.dtype == torch.float32
    np.testing.assert_array_equal(model.bias.detach().numpy(), [0.25, -0.5])

    bn = torch.nn.BatchNorm1d(2)
    state = {name: np.array(a) for name, a in state_dict_to_arrays(bn.state_dict()).items()}
    state["num_batches_tracked"] = np.array(1.5)  # a float where the buffer is int64
    with pytest.raises(InvalidArgument, match=r"num_batches_tracked.*float64.*int64"):
        load_arrays(bn, state)


def test_load_arrays_refuses_names_and_shapes_that_differ() -> None:
    model = torch.nn.Linear(2, 2)
    arrays = {name: np.array(a) for name, a in state_dict_to_arrays(model.state_dict()).items()}
    with pytest.raises(InvalidArgument, match=r"missing \['bias'\], unexpected \['extra'\]"):
        load_arrays(model, {"weight": arrays["weight"], "extra": arrays["bias"]})
    with pytest.raises(InvalidArgument, match=r"'weight' has shape \(2, 3\).*\(2, 2\)"):
        load_arrays(model, {**arrays, "weight": np.zeros((2, 3), np.float32)})


def test_arrays_to_state_dict_shares_writable_arrays_and_copies_read_only_ones() -> None:
    writable = np.arange(6, dtype=np.float32).reshape(2, 3)
    read_only = np.frombuffer(np.arange(3, dtype=np.int64).tobytes(), dtype=np.int64)
    big_endian = np.arange(3, dtype=">f8")
    tensors = arrays_to_state_dict({"w": writable, "r": read_only, "b": big_endian})
    assert np.shares_memory(tensors["w"].numpy(), writable)
    assert not np.shares_memory(tensors["r"].numpy(), read_only)  # and no warning (warnings are errors)
    assert tensors["r"].dtype == torch.int64 and tensors["b"].dtype == torch.float64
    np.testing.assert_array_equal(tensors["b"].numpy(), [0.0, 1.0, 2.0])


def test_bfloat16_arrays_become_bfloat16_tensors_without_a_copy() -> None:
    assert BF16 is not None
    array = np.array([1.5, -2.0, 0.25], dtype=BF16)
    tensor = arrays_to_state_dict({"x": array})["x"]
    assert tensor.dtype == torch.bfloat16
    assert np.shares_memory(tensor.view(torch.int16).numpy(), array.view(np.int16))
    assert tensor.tolist() == [1.5, -2.0, 0.25]


def test_without_ml_dtypes_bfloat16_widens_to_float32_and_still_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(dtypes, "BFLOAT16", None)  # read at call time: the fallback path
    model = _mixed()
    arrays = state_dict_to_arrays(model.state_dict())
    assert arrays["bf16"].dtype == np.float32  # exact: every bfloat16 is a float32
    np.testing.assert_array_equal(arrays["bf16"], np.arange(6, dtype=np.float32).reshape(2, 3))
    target = _mixed(seed=4)
    with torch.no_grad():
        target.bf16.zero_()
    load_arrays(target, {name: np.array(a) for name, a in arrays.items()})
    assert target.bf16.dtype == torch.bfloat16 and torch.equal(target.bf16, model.bf16)


class _CopyingStateDict(torch.nn.Module):
    """A module whose state_dict hands out copies (as some wrappers' hooks do)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.register_state_dict_post_hook(_copy_entries)  # type: ignore[no-untyped-call]


def _copy_entries(
    module: torch.nn.Module, state: OrderedDict[str, torch.Tensor], prefix: str, local: Any
) -> None:
    for key in list(state):
        state[key] = state[key].clone()


def test_a_module_with_state_dict_hooks_is_loaded_through_load_state_dict() -> None:
    model = _CopyingStateDict()
    assert model.state_dict()["fc.weight"].data_ptr() != model.fc.weight.data_ptr()
    arrays = {"fc.weight": np.full((2, 2), 3.0, np.float32), "fc.bias": np.full(2, -1.0, np.float32)}
    for array in arrays.values():
        array.flags.writeable = False
    load_arrays(model, arrays)  # writing into the copies would change nothing
    np.testing.assert_array_equal(model.fc.weight.detach().numpy(), arrays["fc.weight"])
    np.testing.assert_array_equal(model.fc.bias.detach().numpy(), arrays["fc.bias"])


@pytest.mark.parametrize(
    ("tensor", "reason"),
    [
        (torch.zeros(2, dtype=torch.complex64), "complex64, which has no wire form"),
        (torch.zeros(2).to_sparse(), "sparse_coo"),
        (torch.zeros(2, device="meta"), "meta device"),
    ],
    ids=["complex", "sparse", "meta"],
)
def test_tensors_without_a_wire_form_are_refused_by_name(tensor: torch.Tensor, reason: str) -> None:
    with pytest.raises(InvalidArgument, match=f"'odd'.*{reason}"):
        state_dict_to_arrays({"odd": tensor})
