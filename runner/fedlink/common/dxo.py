"""The data exchange object (DXO): what tasks carry to devices and results carry back.

:class:`DXO` is the in-process form (numpy arrays, Python metadata); it converts to and from the wire
message :class:`fedlink.v1.dxo_pb2.Dxo`, its serialized bytes (what blobs hold), and NVIDIA FLARE's dict
form ``{"kind": ..., "data": ..., "meta": ...}``. Names follow NVFlare's ``DXO`` so its users feel at
home: ``DataKind``, ``MetaKey``, ``get_meta_prop``/``set_meta_prop``.

Metadata values travel typed (see ``MetaValue`` in ``dxo.proto``): ``bool``, ``int`` (signed 64-bit),
``float``, ``str`` and ``bytes`` as themselves; lists, tuples and dicts as a JSON document (strict JSON:
no NaN or infinity inside them), which decodes back to lists and dicts. numpy scalars are accepted
and sent as the matching Python type.

Decoding a DXO from the wire first checks its structure against fixed limits (:data:`MAX_TENSORS`,
:data:`MAX_ITEMS`, :data:`MAX_META_ENTRIES`, :data:`MAX_META_BYTES`, and
:data:`~fedlink.common.json_limits.MAX_JSON_DEPTH` inside JSON values), before anything is decoded. They
are far above what a model or its metrics need, and they are constants rather than settings because a
DXO crosses the wire both ways and is read again from the store: a limit that one side could raise
would let in DXOs that the other side refuses.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError

from fedlink.common import dtypes
from fedlink.common.errors import InvalidArgument
from fedlink.common.json_limits import load_json
from fedlink.common.tensors import (
    MAX_TENSOR_ELEMENTS,
    TensorEncoding,
    decode_tensor,
    fill_tensor,
    tensor_encoding,
)
from fedlink.common.wire_slices import merge_in_slices
from fedlink.v1 import dxo_pb2

__all__ = [
    "DXO",
    "MAX_ITEMS",
    "MAX_META_BYTES",
    "MAX_META_ENTRIES",
    "MAX_TENSORS",
    "DataKind",
    "MetaKey",
    "MetaValue",
    "check_structure",
    "parse_dxo",
    "weight_of",
]

MetaValue: TypeAlias = int | float | str | bool | bytes | list[Any] | dict[str, Any]
"""A metadata value. Lists and dicts travel as JSON (``MetaValue.json_value``)."""

MAX_TENSORS: Final[int] = 100_000
"""Most tensors one DXO may carry, its items' included (a model's variables: a few thousand at most)."""
MAX_ITEMS: Final[int] = 10_000
"""Most nested DXOs one ``COLLECTION`` may hold, at every level together."""
MAX_META_ENTRIES: Final[int] = 1_000
"""Most metadata entries one DXO may carry, its items' included."""
MAX_META_BYTES: Final[int] = 1024 * 1024
"""Most bytes of metadata one DXO may carry, its items' included: keys and serialized values."""

_INT64_MIN: Final[int] = -(2**63)
_INT64_MAX: Final[int] = 2**63 - 1


class DataKind(enum.StrEnum):
    """What a DXO's data means (NVFlare's names)."""

    WEIGHTS = "WEIGHTS"
    WEIGHT_DIFF = "WEIGHT_DIFF"
    METRICS = "METRICS"
    COLLECTION = "COLLECTION"
    APP_DEFINED = "APP_DEFINED"


class MetaKey:
    """Well-known metadata keys."""

    NUM_EXAMPLES: Final[str] = "num_examples"
    """The number of training examples behind a result: its aggregation weight."""
    NUM_STEPS_CURRENT_ROUND: Final[str] = "num_steps_current_round"
    """The number of training steps behind a result: the weight when ``num_examples`` is absent."""
    MODEL_VERSION: Final[str] = "model_version"
    """The version of the global model a task carried, or a result was computed from."""


_KIND_TO_PROTO: Final[dict[str, dxo_pb2.DataKind.ValueType]] = {
    DataKind.WEIGHTS: dxo_pb2.DATA_KIND_WEIGHTS,
    DataKind.WEIGHT_DIFF: dxo_pb2.DATA_KIND_WEIGHT_DIFF,
    DataKind.METRICS: dxo_pb2.DATA_KIND_METRICS,
    DataKind.COLLECTION: dxo_pb2.DATA_KIND_COLLECTION,
    DataKind.APP_DEFINED: dxo_pb2.DATA_KIND_APP_DEFINED,
}
_KIND_FROM_PROTO: Final[dict[int, DataKind]] = {v: DataKind(k) for k, v in _KIND_TO_PROTO.items()}
_DICT_KEYS: Final[frozenset[str]] = frozenset({"kind", "data", "meta"})


@dataclass(slots=True)
class DXO:
    """A data exchange object.

    Attributes:
        kind: What ``data`` means.
        data: Variable name to array. Empty for ``COLLECTION``.
        meta: Name to metadata value (see :data:`MetaKey` for the well-known ones).
        items: Nested DXOs by name; only for ``COLLECTION``.
        encodings: Per-variable wire encoding; a missing name means dense. Compression filters set it;
            :meth:`from_proto` fills it from the wire.
    """

    kind: DataKind
    data: dict[str, npt.NDArray[Any]] = field(default_factory=dict)
    meta: dict[str, MetaValue] = field(default_factory=dict)
    items: dict[str, DXO] = field(default_factory=dict)
    encodings: dict[str, TensorEncoding] = field(default_factory=dict)

    def nbytes(self) -> int:
        """Bytes of the tensor data, this DXO's and its items' (about its serialized size)."""
        return sum(int(a.nbytes) for a in self.data.values()) + sum(i.nbytes() for i in self.items.values())

    def validate(self) -> None:
        """Check the structure (recursively for ``items``); values such as NaN are not checked here.

        Raises:
            InvalidArgument: Unknown kind, data that is not a numpy array of a supported dtype, an
                encoding for a variable that is not in ``data``, items on a kind other than
                ``COLLECTION``, or data on a ``COLLECTION``.
        """
        self._validate("")

    def to_proto(self) -> dxo_pb2.Dxo:
        """The wire message, with each variable in its encoding from :attr:`encodings`.

        Raises:
            InvalidArgument: As :meth:`validate`, or a value that has no wire form.
        """
        self.validate()
        message = dxo_pb2.Dxo()
        self._write(message, "")
        return message

    @classmethod
    def from_proto(cls, message: dxo_pb2.Dxo, *, max_elements: int = MAX_TENSOR_ELEMENTS) -> DXO:
        """Decode a wire message. Dense tensors become read-only views (see :mod:`fedlink.common.tensors`).

        Args:
            message: The DXO.
            max_elements: Refuse any tensor with more elements than this.

        Raises:
            InvalidArgument: Unknown or unspecified kind, a malformed tensor or metadata value, items on
                a kind other than ``COLLECTION``, or a limit of :func:`check_structure` exceeded
                (checked before anything is decoded).
        """
        check_structure(message)
        return cls._read(message, "", max_elements)

    def to_bytes(self) -> bytes:
        """The serialized wire message, what a blob holds.

        Serialization is deterministic (map entries sorted), so equal DXOs give equal bytes and hashes.
        """
        return self.to_proto().SerializeToString(deterministic=True)

    @classmethod
    def from_bytes(cls, data: bytes, *, max_elements: int = MAX_TENSOR_ELEMENTS) -> DXO:
        """Parse serialized bytes of a ``Dxo`` message.

        Raises:
            InvalidArgument: The bytes are not a valid ``Dxo`` message, or it does not decode.
        """
        return cls.from_proto(parse_dxo(data), max_elements=max_elements)

    def to_dict(self) -> dict[str, Any]:
        """NVFlare's dict form; for ``COLLECTION`` ``data`` holds the items' dicts. Arrays are not copied."""
        data: dict[str, Any]
        if self.kind == DataKind.COLLECTION:
            data = {name: item.to_dict() for name, item in self.items.items()}
        else:
            data = dict(self.data)
        return {"kind": str(self.kind), "data": data, "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DXO:
        """Build a DXO from NVFlare's dict form.

        Arrays may also be (nested) lists of numbers, as NVFlare's edge JSON sends them; they become
        arrays with numpy's default dtype for them (int64 or float64).

        Raises:
            InvalidArgument: Not a mapping, missing or unknown kind, unknown keys, ragged lists, or
                anything :meth:`validate` refuses.
        """
        dxo = cls._from_dict(d, "")
        dxo.validate()
        return dxo

    def get_meta_prop(self, key: str, default: MetaValue | None = None) -> MetaValue | None:
        """The metadata value for ``key``, or ``default``."""
        return self.meta.get(key, default)

    def set_meta_prop(self, key: str, value: MetaValue) -> None:
        """Set a metadata value."""
        self.meta[key] = value

    def _validate(self, path: str) -> None:
        if not isinstance(self.kind, str) or self.kind not in _KIND_TO_PROTO:
            raise InvalidArgument(
                f"{_where(path)}unknown kind {self.kind!r}; expected one of {', '.join(DataKind)}"
            )
        for name in (*self.data, *self.items, *self.meta):
            if not isinstance(name, str):
                raise InvalidArgument(f"{_where(path)}name {name!r} is not a string")
        for name, array in self.data.items():
            if not isinstance(array, np.ndarray):
                raise InvalidArgument(
                    f"{_where(path)}data {name!r} is a {type(array).__name__}, not a numpy array"
                )
            dtypes.dtype_name(array.dtype, tensor=path + name)
        for name, encoding in self.encodings.items():
            if name not in self.data:
                raise InvalidArgument(f"{_where(path)}encoding given for {name!r}, which is not in data")
            if encoding not in TensorEncoding.__members__.values():
                raise InvalidArgument(f"{_where(path)}unknown encoding {encoding!r} for {name!r}")
        if self.kind == DataKind.COLLECTION:
            if self.data:
                raise InvalidArgument(
                    f"{_where(path)}a COLLECTION keeps its contents in items, not data ({sorted(self.data)})"
                )
            for name, item in self.items.items():
                if not isinstance(item, DXO):
                    raise InvalidArgument(
                        f"{_where(path)}item {name!r} is a {type(item).__name__}, not a DXO"
                    )
                item._validate(f"{path}{name}/")
        elif self.items:
            raise InvalidArgument(f"{_where(path)}items are only for COLLECTION, not {self.kind}")

    def _write(self, message: dxo_pb2.Dxo, path: str) -> None:
        message.kind = _KIND_TO_PROTO[self.kind]
        for name, array in self.data.items():
            encoding = self.encodings.get(name, TensorEncoding.DENSE)
            # Fill the map entry in place: building a Tensor and assigning it would copy its bytes.
            fill_tensor(message.data[name], array, TensorEncoding(encoding), name=path + name)
        for key, value in self.meta.items():
            _write_meta(message.meta[key], value, path + key)
        for name, item in self.items.items():
            item._write(message.items[name], f"{path}{name}/")

    @classmethod
    def _read(cls, message: dxo_pb2.Dxo, path: str, max_elements: int) -> DXO:
        kind = _KIND_FROM_PROTO.get(message.kind)
        if kind is None:
            raise InvalidArgument(
                f"{_where(path)}unknown or unspecified kind {message.kind}; "
                f"expected one of {', '.join(DataKind)}"
            )
        if message.items and kind != DataKind.COLLECTION:
            raise InvalidArgument(f"{_where(path)}items are only for COLLECTION, not {kind}")
        data: dict[str, npt.NDArray[Any]] = {}
        encodings: dict[str, TensorEncoding] = {}
        for name, tensor in message.data.items():
            data[name] = decode_tensor(tensor, name=path + name, max_elements=max_elements)
            encodings[name] = tensor_encoding(tensor)
        meta = {key: _read_meta(value, path + key) for key, value in message.meta.items()}
        items = {
            name: cls._read(item, f"{path}{name}/", max_elements) for name, item in message.items.items()
        }
        return cls(kind=kind, data=data, meta=meta, items=items, encodings=encodings)

    @classmethod
    def _from_dict(cls, d: Mapping[str, Any], path: str) -> DXO:
        if not isinstance(d, Mapping):
            raise InvalidArgument(f"{_where(path)}a DXO dict must be a mapping, not {type(d).__name__}")
        unknown = set(d) - _DICT_KEYS
        if unknown:
            raise InvalidArgument(f"{_where(path)}unknown DXO keys {sorted(map(str, unknown))}")
        if "kind" not in d:
            raise InvalidArgument(f"{_where(path)}a DXO dict needs a 'kind'")
        raw_kind = d["kind"]
        if not isinstance(raw_kind, str) or raw_kind not in _KIND_TO_PROTO:
            raise InvalidArgument(
                f"{_where(path)}unknown kind {raw_kind!r}; expected one of {', '.join(DataKind)}"
            )
        kind = DataKind(raw_kind)
        data = _mapping(d.get("data"), "data", path)
        meta = _mapping(d.get("meta"), "meta", path)
        if kind == DataKind.COLLECTION:
            items = {
                name: item if isinstance(item, DXO) else cls._from_dict(item, f"{path}{name}/")
                for name, item in data.items()
            }
            return cls(kind=kind, meta=dict(meta), items=items)
        arrays = {name: _as_array(value, path + str(name)) for name, value in data.items()}
        return cls(kind=kind, data=arrays, meta=dict(meta))


def parse_dxo(data: bytes, *, slice_bytes: int | None = None) -> dxo_pb2.Dxo:
    """Parses serialized bytes into the wire message, decoding nothing (see :meth:`DXO.from_proto`).

    Args:
        data: The serialized ``Dxo``.
        slice_bytes: Parse about this many bytes of fields at a time (see
            :func:`~fedlink.common.wire_slices.merge_in_slices`), so that a worker thread parsing a
            large DXO lets the other threads run in between; None: in one call.

    Raises:
        InvalidArgument: The bytes are not a valid ``Dxo`` message.
    """
    message = dxo_pb2.Dxo()
    try:
        if slice_bytes is None:
            message.ParseFromString(data)
        else:
            merge_in_slices(message, data, slice_bytes)
    except DecodeError as exc:
        raise InvalidArgument(f"DXO bytes are not a valid fedlink.v1.Dxo message: {exc}") from None
    return message


def check_structure(message: dxo_pb2.Dxo) -> None:
    """Checks a wire DXO against the limits on its structure, without decoding anything.

    Raises:
        InvalidArgument: More than :data:`MAX_TENSORS` tensors, :data:`MAX_ITEMS` items,
            :data:`MAX_META_ENTRIES` metadata entries or :data:`MAX_META_BYTES` of metadata.
    """
    tally = _Tally()
    pending = [message]
    while pending:
        current = pending.pop()
        tally.count(tensors=len(current.data), items=len(current.items))
        tally.count_meta(current.meta)
        pending.extend(current.items.values())


@dataclass(slots=True)
class _Tally:
    """What of a DXO's structure was read so far, refused as soon as it passes a limit."""

    tensors: int = 0
    items: int = 0
    meta_entries: int = 0
    meta_bytes: int = 0

    def count(self, *, tensors: int = 0, items: int = 0) -> None:
        self.tensors += tensors
        self.items += items
        if self.tensors > MAX_TENSORS:
            raise InvalidArgument(f"DXO: more than the limit of {MAX_TENSORS} tensors in one DXO")
        if self.items > MAX_ITEMS:
            raise InvalidArgument(f"DXO: more than the limit of {MAX_ITEMS} items in one DXO")

    def count_meta(self, meta: Mapping[str, dxo_pb2.MetaValue]) -> None:
        self.meta_entries += len(meta)
        if self.meta_entries > MAX_META_ENTRIES:
            raise InvalidArgument(f"DXO: more than the limit of {MAX_META_ENTRIES} meta entries in one DXO")
        # ByteSize() measures a value without copying it out of the message.
        self.meta_bytes += sum(len(key.encode()) + value.ByteSize() for key, value in meta.items())
        if self.meta_bytes > MAX_META_BYTES:
            raise InvalidArgument(f"DXO: more than the limit of {MAX_META_BYTES} bytes of meta in one DXO")


def weight_of(dxo: DXO) -> float:
    """The aggregation weight of a result: ``meta.num_examples``, else ``meta.num_steps_current_round``.

    Raises:
        InvalidArgument: Neither key is present, or the one used is not a finite number > 0.
    """
    for key in (MetaKey.NUM_EXAMPLES, MetaKey.NUM_STEPS_CURRENT_ROUND):
        if key in dxo.meta:
            value = dxo.meta[key]
            # bool is an int in Python, but True is no example count.
            if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.number):
                raise InvalidArgument(
                    f"meta {key!r} must be a number > 0, got {type(value).__name__} {value!r}"
                )
            weight = float(value)
            if not math.isfinite(weight) or weight <= 0:
                raise InvalidArgument(
                    f"meta {key!r} must be a finite number > 0 to weigh the result, got {value!r}"
                )
            return weight
    raise InvalidArgument(
        f"the result has neither meta {MetaKey.NUM_EXAMPLES!r} nor {MetaKey.NUM_STEPS_CURRENT_ROUND!r}; "
        "set one to the number of training examples (or steps) behind it"
    )


def _write_meta(target: dxo_pb2.MetaValue, value: object, key: str) -> None:
    # bool first: it is a subclass of int.
    if isinstance(value, bool | np.bool_):
        target.bool_value = bool(value)
    elif isinstance(value, int | np.integer):
        number = int(value)
        if not _INT64_MIN <= number <= _INT64_MAX:
            raise InvalidArgument(f"meta {key!r}: integer {number} does not fit in 64 bits")
        target.int_value = number
    elif isinstance(value, float | np.floating):
        target.double_value = float(value)
    elif isinstance(value, str):
        target.string_value = value
    elif isinstance(value, bytes | bytearray):
        target.bytes_value = bytes(value)
    elif isinstance(value, list | tuple | dict):
        try:
            target.json_value = json.dumps(value, allow_nan=False, default=_json_default)
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"meta {key!r}: cannot be sent as JSON: {exc}") from None
    else:
        raise InvalidArgument(
            f"meta {key!r}: a {type(value).__name__} has no wire form; "
            "use int, float, str, bool, bytes, list or dict"
        )


def _read_meta(value: dxo_pb2.MetaValue, key: str) -> MetaValue:
    which = value.WhichOneof("kind")
    if which == "int_value":
        return value.int_value
    if which == "double_value":
        return value.double_value
    if which == "string_value":
        return value.string_value
    if which == "bool_value":
        return value.bool_value
    if which == "bytes_value":
        return value.bytes_value
    if which == "json_value":
        # Its size is bounded with all of the DXO's meta (check_structure), its depth here.
        decoded: MetaValue = load_json(value.json_value, what=f"meta {key!r}: json_value")
        return decoded
    raise InvalidArgument(f"meta {key!r}: no value set (one of int, double, string, bool, bytes, json)")


def _json_default(value: object) -> object:
    # numpy values inside lists and dicts (e.g. per-class accuracies) as their Python equivalents.
    if isinstance(value, np.ndarray | np.generic):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _mapping(value: object, what: str, path: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{_where(path)}{what!r} must be a mapping, not {type(value).__name__}")
    return value


def _as_array(value: object, name: str) -> npt.NDArray[Any]:
    if isinstance(value, np.ndarray):
        return value
    if not isinstance(value, list | tuple | int | float | bool | np.generic):
        raise InvalidArgument(f"data {name!r} is a {type(value).__name__}, not an array or a list of numbers")
    try:
        return np.asarray(value)
    except (ValueError, OverflowError, TypeError) as exc:
        raise InvalidArgument(f"data {name!r} is not a rectangular array of numbers: {exc}") from None


def _where(path: str) -> str:
    return f"DXO item {path.rstrip('/')!r}: " if path else "DXO: "
