"""``state_dict`` <-> named numpy arrays (a DXO's data), keeping names and dtypes, copying only when needed.

When nothing is copied, and when something must be:

* **CPU tensors of a numpy dtype** (float16/32/64, int8-64, uint8-64, bool): no copy.
  :func:`state_dict_to_arrays` gives views of their memory (``Tensor.numpy()``; a non-contiguous
  tensor gives a strided view, made contiguous only when the DXO is encoded for the wire), and
  :func:`load_arrays` writes each array straight into the module's parameter or buffer — the one
  copy that must happen, since the module owns its memory.
* **bfloat16**, with ``ml_dtypes`` installed (``fedlink[bfloat16]``): the same, through a 16-bit
  integer view. Without it, a float32 copy (exact), as the wire decoder does
  (:mod:`fedlink.common.dtypes`): the model then travels as float32, and the coordinator must agree.
* **GPU (any non-CPU) tensors**: copied to the host one tensor at a time (``.cpu()``); loading goes
  through a host tensor (itself a copy of a read-only array), then one host-to-device copy.
* **Read-only arrays** (every array decoded from the wire or handed out by the simulation),
  big-endian or negatively strided ones: :func:`arrays_to_state_dict` copies them, as PyTorch cannot
  share read-only memory; :func:`load_arrays` into a CPU module needs no copy of them.
* **Complex, float8, quantized, sparse and meta tensors**: refused (no wire form), with an
  :class:`~fedlink.common.errors.InvalidArgument` that names the tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from fedlink.common import dtypes
from fedlink.common.errors import InvalidArgument

__all__ = ["arrays_to_state_dict", "load_arrays", "state_dict_to_arrays", "tensor_to_array"]

# The dtypes Tensor.numpy() can view without a copy (bfloat16 has its own path below).
_NUMPY_VIEWABLE = frozenset(
    {
        torch.float16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.bool,
    }
)


def state_dict_to_arrays(state_dict: Mapping[str, torch.Tensor]) -> dict[str, npt.NDArray[Any]]:
    """The tensors of a ``state_dict`` as numpy arrays of the same names, shapes and dtypes.

    CPU tensors become views of their memory, not copies (see the module doc for the exceptions):
    they change when the model does. Copy them (``np.array``) to keep a snapshot.

    Raises:
        InvalidArgument: A tensor with no wire form (complex, float8, quantized, sparse, meta); the
            message names it.
    """
    return {name: tensor_to_array(name, tensor) for name, tensor in state_dict.items()}


def tensor_to_array(name: str, tensor: torch.Tensor) -> npt.NDArray[Any]:
    """One tensor as a numpy array (a view of a CPU tensor's memory); ``name`` is for the error."""
    tensor = _plain(name, tensor).detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:
        bf16 = dtypes.native_bfloat16()
        if bf16 is None:
            return tensor.float().numpy()  # exact: every bfloat16 is a float32
        return tensor.view(torch.int16).numpy().view(bf16)
    return tensor.numpy()


def arrays_to_state_dict(
    arrays: Mapping[str, npt.NDArray[Any]], *, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """Named numpy arrays as tensors of the same names, shapes and dtypes (on ``device`` if given).

    A writable, native-byte-order array becomes a tensor sharing its memory (``torch.from_numpy``);
    a read-only one (as decoded from the wire), a big-endian or a negatively strided one is copied.
    Moving to a non-CPU ``device`` copies. To put a model's weights into a module, prefer
    :func:`load_arrays`, which needs no copy of read-only arrays.

    Raises:
        InvalidArgument: A value that is not a numpy array of a wire dtype (the message names it).
    """
    result: dict[str, torch.Tensor] = {}
    for name, array in arrays.items():
        tensor = _array_to_tensor(name, array)
        result[name] = tensor if device is None else tensor.to(device)
    return result


def load_arrays(module: torch.nn.Module, arrays: Mapping[str, npt.NDArray[Any]]) -> None:
    """Sets every entry of ``module.state_dict()`` from the array of the same name, in place.

    The arrays must name exactly the module's ``state_dict`` entries, with the same shapes; values are
    cast to each entry's dtype when the cast keeps their kind (float64 into float32: yes; float into
    an integer buffer: no). For a CPU module whose ``state_dict`` entries are its own parameters and
    buffers (any module without state-dict hooks of its own), each array is copied straight into the
    tensor's memory — read-only arrays included, with no intermediate copy. Otherwise (a GPU module,
    bfloat16 without ``ml_dtypes``, a module with state-dict hooks) it goes through
    :func:`arrays_to_state_dict` and ``module.load_state_dict``.

    Raises:
        InvalidArgument: Missing or unexpected names, a shape that differs, or a value that cannot be
            cast (the message names the entry).
    """
    targets = module.state_dict()
    missing = [name for name in targets if name not in arrays]
    unexpected = [name for name in arrays if name not in targets]
    if missing or unexpected:
        raise InvalidArgument(
            f"the model's variables do not match the module's state_dict: missing {missing}, "
            f"unexpected {unexpected}"
        )
    for name, target in targets.items():
        source = arrays[name]
        if not isinstance(source, np.ndarray):
            raise InvalidArgument(f"variable {name!r} is a {type(source).__name__}, not a numpy array")
        if tuple(source.shape) != tuple(target.shape):
            raise InvalidArgument(
                f"variable {name!r} has shape {tuple(source.shape)}; the module's is {tuple(target.shape)}"
            )
    owned = _own_tensors(module)
    if all(_writable_in_place(name, target, owned) for name, target in targets.items()):
        for name, target in targets.items():
            _copy_array(name, arrays[name], tensor_to_array(name, target))
        return
    tensors = {name: _cast_tensor(name, arrays[name], target.dtype) for name, target in targets.items()}
    module.load_state_dict(tensors, strict=True)


def _plain(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgument(f"state_dict entry {name!r} is a {type(tensor).__name__}, not a tensor")
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_meta:
        raise InvalidArgument(
            f"tensor {name!r} is {tensor.layout}{' quantized' if tensor.is_quantized else ''}"
            f"{' on the meta device' if tensor.is_meta else ''}: only dense tensors with data can be sent"
        )
    if tensor.dtype not in _NUMPY_VIEWABLE and tensor.dtype != torch.bfloat16:
        raise InvalidArgument(
            f"tensor {name!r} has dtype {tensor.dtype}, which has no wire form; convert it to one of "
            f"{', '.join(sorted(dtypes.SUPPORTED_DTYPES))}"
        )
    return tensor


def _own_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    owned: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    owned.update(module.named_buffers(remove_duplicate=False))
    return owned


def _writable_in_place(name: str, target: torch.Tensor, owned: Mapping[str, torch.Tensor]) -> bool:
    """Whether writing into ``target``'s numpy view updates the module (no state-dict hook in between)."""
    own = owned.get(name)
    return (
        own is not None
        and target.device.type == "cpu"
        and own.data_ptr() == target.data_ptr()
        and own.dtype == target.dtype
        and (target.dtype in _NUMPY_VIEWABLE or dtypes.native_bfloat16() is not None)
    )


def _copy_array(name: str, source: npt.NDArray[Any], view: npt.NDArray[Any]) -> None:
    try:
        np.copyto(view, source, casting="same_kind")
    except TypeError:
        raise InvalidArgument(
            f"variable {name!r} is {source.dtype}; it cannot be cast to {view.dtype}"
        ) from None


def _cast_tensor(name: str, source: npt.NDArray[Any], dtype: torch.dtype) -> torch.Tensor:
    tensor = _array_to_tensor(name, source)
    if tensor.dtype != dtype and not torch.can_cast(tensor.dtype, dtype):
        raise InvalidArgument(f"variable {name!r} is {source.dtype}; it cannot be cast to {dtype}")
    return tensor


def _array_to_tensor(name: str, array: npt.NDArray[Any]) -> torch.Tensor:
    if not isinstance(array, np.ndarray):
        raise InvalidArgument(f"variable {name!r} is a {type(array).__name__}, not a numpy array")
    dtypes.dtype_name(array.dtype, tensor=name)  # refuses what has no wire form
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    # torch.from_numpy warns on read-only memory (and tests turn warnings into errors) and cannot
    # take negative strides: those are copied.
    if not array.flags.writeable or any(stride < 0 for stride in array.strides):
        array = np.array(array)
    bf16 = dtypes.BFLOAT16
    if bf16 is not None and array.dtype == bf16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
