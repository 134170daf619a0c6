"""A serialized DXO's outline (kind, metadata, each tensor's dtype, shape and encoding) read from a stream.

:meth:`DXO.from_bytes <fedlink.common.dxo.DXO.from_bytes>` needs the whole message in memory, and
decoding it copies the tensor bytes again: a 1 GiB model costs several GiB to parse. What a coordinator
wants to know of a model before handing it out (its kind, names, dtypes and shapes, and that it would
decode) does not need the tensor bytes at all. :func:`read_outline` walks the protobuf wire format of
``fedlink.v1.Dxo`` chunk by chunk, skips over the tensor data fields (only their lengths are checked
against dtype × shape), and keeps a few bytes per tensor.

It accepts exactly what the protobuf runtime accepts: fields in any order, unknown fields (skipped),
a known field with an unexpected wire type (an unknown field, as the runtime treats it), packed and
unpacked ``shape``, repeated map entries (the last wins) and a message field given twice (merged). On
top of that it checks what :meth:`DXO.from_proto <fedlink.common.dxo.DXO.from_proto>` checks, except that
it does not decode tensor values: the only values it reads are sparse indices (in range, strictly
increasing), chunk by chunk. The limits on a DXO's structure (see
:func:`~fedlink.common.dxo.check_structure`) are kept while it reads. Every problem raises
:class:`~fedlink.common.errors.InvalidArgument`.

:class:`DeclaredDxo` is a message already parsed, seen by what it declares of each tensor before
anything is decoded, so that a DXO can be checked against what it should be (a model's variables)
before :meth:`DXO.from_proto <fedlink.common.dxo.DXO.from_proto>` builds any array.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Final

import numpy as np
from google.protobuf.internal.containers import MessageMap
from google.protobuf.message import DecodeError

from fedlink.common import dtypes
from fedlink.common.dtypes import FLOAT_DTYPES
from fedlink.common.dxo import DXO, DataKind, MetaValue, _read_meta, _Tally, check_structure, parse_dxo
from fedlink.common.errors import InvalidArgument
from fedlink.common.tensors import (
    MAX_TENSOR_ELEMENTS,
    TensorEncoding,
    check_sparse_count,
    element_count,
    tensor_encoding,
)
from fedlink.v1 import dxo_pb2

__all__ = ["DeclaredDxo", "DxoOutline", "TensorOutline", "read_outline"]

#: Chunks the reader asks for from an offset: ``open_at(offset)`` yields the bytes from there on.
OpenAt = Callable[[int], AsyncIterator[bytes]]

#: A skip longer than this reopens the source past it instead of reading through it.
SEEK_BYTES: Final[int] = 4 * 1024 * 1024

_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5
_KIND_FROM_PROTO: Final[dict[int, DataKind]] = {
    dxo_pb2.DATA_KIND_WEIGHTS: DataKind.WEIGHTS,
    dxo_pb2.DATA_KIND_WEIGHT_DIFF: DataKind.WEIGHT_DIFF,
    dxo_pb2.DATA_KIND_METRICS: DataKind.METRICS,
    dxo_pb2.DATA_KIND_COLLECTION: DataKind.COLLECTION,
    dxo_pb2.DATA_KIND_APP_DEFINED: DataKind.APP_DEFINED,
}
_INDEX: Final = np.dtype("<i8")
_DEPTH: Final[int] = 100  # the protobuf runtime's default recursion limit


@dataclass(frozen=True, slots=True)
class TensorOutline:
    """What a tensor is, without its values."""

    #: The wire dtype name (``float32``, ``bfloat16``, ...).
    dtype: str
    shape: tuple[int, ...]
    encoding: TensorEncoding

    @property
    def decoded_dtype(self) -> np.dtype[np.generic]:
        """The dtype the decoded array has (what :meth:`DXO.from_bytes` would give)."""
        return dtypes.decoded_dtype(self.dtype)

    @property
    def decoded_nbytes(self) -> int:
        """The size of the decoded array in bytes."""
        return math.prod(self.shape) * self.decoded_dtype.itemsize


@dataclass(frozen=True, slots=True)
class DxoOutline:
    """A DXO without its tensor values."""

    kind: DataKind
    tensors: dict[str, TensorOutline]
    meta: dict[str, MetaValue]
    items: dict[str, DxoOutline]

    def decoded_nbytes(self) -> int:
        """The size in bytes of the arrays this DXO decodes to, its items' included."""
        return sum(t.decoded_nbytes for t in self.tensors.values()) + sum(
            i.decoded_nbytes() for i in self.items.values()
        )


async def read_outline(
    open_at: OpenAt, size_bytes: int, *, max_elements: int = MAX_TENSOR_ELEMENTS, seek_bytes: int = SEEK_BYTES
) -> DxoOutline:
    """Reads the outline of the serialized ``Dxo`` of ``size_bytes`` bytes that ``open_at(0)`` yields.

    Args:
        open_at: Yields the serialized bytes from an offset on, in chunks of any size. Called again
            with a later offset to jump over a large tensor field.
        size_bytes: The serialized message's length.
        max_elements: Refuse any tensor with more elements than this.
        seek_bytes: Skips longer than this reopen ``open_at`` past them.

    Raises:
        InvalidArgument: Exactly when :meth:`DXO.from_bytes` would, the message naming what is wrong.
    """
    source = _Source(open_at, seek_bytes)
    tally = _Tally()
    try:
        message = _Message()
        await _parse_dxo(source, size_bytes, message, 0, tally)
        if source.offset != size_bytes:  # pragma: no cover - _parse_dxo reads up to its end exactly
            raise _Malformed("the message does not end where its length says")
    except _Malformed as exc:
        raise InvalidArgument(f"DXO bytes are not a valid fedlink.v1.Dxo message: {exc}") from None
    finally:
        await source.close()
    return _finish(message, "", max_elements, tally)


class DeclaredDxo:
    """A parsed wire DXO, not decoded yet: its kind, and each tensor as declared (outlined on lookup).

    For checking a DXO against what it should be (a model's variables) before :meth:`decode` builds
    any array; decoding then allocates no more than the tensors declare. The limits on the DXO's
    structure (:func:`~fedlink.common.dxo.check_structure`), its kind, and that only a ``COLLECTION``
    has items are checked when it is made; each tensor's dtype, shape and encoding when it is looked
    up in :attr:`tensors` (so that a check can stop at the first wrong one); the tensors' byte lengths
    and values, and the metadata, when it is decoded.
    """

    def __init__(self, message: dxo_pb2.Dxo, *, max_elements: int = MAX_TENSOR_ELEMENTS) -> None:
        """Raises InvalidArgument if ``message`` exceeds a limit or has the wrong kind for items."""
        check_structure(message)
        self.kind = _kind(message.kind, "")
        if message.items and self.kind != DataKind.COLLECTION:
            raise InvalidArgument(f"DXO: items are only for COLLECTION, not {self.kind}")
        self._message = message
        self._max_elements = max_elements
        #: The top level's tensors by name, each outlined when looked up.
        self.tensors: Mapping[str, TensorOutline] = _DeclaredTensors(message.data, "", max_elements)

    @classmethod
    def parse(
        cls, data: bytes, *, max_elements: int = MAX_TENSOR_ELEMENTS, slice_bytes: int | None = None
    ) -> DeclaredDxo:
        """Parses serialized bytes of a ``Dxo`` message, decoding nothing (``slice_bytes``: see
        :func:`~fedlink.common.dxo.parse_dxo`).

        Raises:
            InvalidArgument: Not a valid ``Dxo`` message, or as the constructor.
        """
        return cls(parse_dxo(data, slice_bytes=slice_bytes), max_elements=max_elements)

    def canonical_bytes(self) -> bytes:
        """The message serialized deterministically (map entries by key): the same for the same DXO
        whatever order its sender wrote it in."""
        return self._message.SerializeToString(deterministic=True)

    def tensor_count(self) -> int:
        """How many tensors the DXO carries, its items' included."""
        total = 0
        pending = [self._message]
        while pending:
            message = pending.pop()
            total += len(message.data)
            pending.extend(message.items.values())
        return total

    def decoded_nbytes(self) -> int:
        """The size in bytes of the arrays :meth:`decode` would build, its items' included.

        Raises:
            InvalidArgument: A tensor's dtype or shape is malformed.
        """
        total = 0
        pending: list[tuple[dxo_pb2.Dxo, str]] = [(self._message, "")]
        while pending:
            message, path = pending.pop()
            total += sum(
                t.decoded_nbytes for t in _DeclaredTensors(message.data, path, self._max_elements).values()
            )
            pending.extend((item, f"{path}{name}/") for name, item in message.items.items())
        return total

    def decode(self) -> DXO:
        """The DXO (see :meth:`DXO.from_proto <fedlink.common.dxo.DXO.from_proto>`).

        Raises:
            InvalidArgument: As :meth:`DXO.from_proto`.
        """
        return DXO.from_proto(self._message, max_elements=self._max_elements)


class _DeclaredTensors(Mapping[str, TensorOutline]):
    """A wire DXO's tensors by name, each outlined (dtype, shape, encoding checked) when looked up."""

    def __init__(self, data: MessageMap[str, dxo_pb2.Tensor], path: str, max_elements: int) -> None:
        self._data = data
        self._path = path
        self._max_elements = max_elements

    def __getitem__(self, name: str) -> TensorOutline:
        if name not in self._data:  # a lookup would add the entry to the map
            raise KeyError(name)
        tensor = self._data[name]
        label = self._path + name
        element_count(tensor.dtype, tensor.shape, name=label, max_elements=self._max_elements)
        encoding = tensor_encoding(tensor, name=label)
        return TensorOutline(dtype=tensor.dtype, shape=tuple(tensor.shape), encoding=encoding)

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class _Malformed(Exception):
    """The bytes are not a valid protobuf message (what the runtime's DecodeError means)."""


# ---- the parsed state: what merging fields needs, nothing more ----


@dataclass(slots=True)
class _Indices:
    """What was learnt of one sparse ``indices`` field while streaming over it."""

    length: int = 0
    first: int = 0
    last: int = 0
    #: (position, value, previous) of the first index not above the one before it.
    disorder: tuple[int, int, int] | None = None


@dataclass(slots=True)
class _Tensor:
    dtype: str = ""
    shape: list[int] = field(default_factory=list)
    encoding: TensorEncoding | None = None
    data_bytes: int = 0  # dense or float16 data
    values_bytes: int = 0  # sparse values
    indices: _Indices = field(default_factory=_Indices)


@dataclass(slots=True)
class _Message:
    kind: int = 0
    tensors: dict[str, _Tensor] = field(default_factory=dict)
    #: The serialized ``meta`` map entries, re-tagged, in order: small, decoded by protobuf at the end.
    meta: bytearray = field(default_factory=bytearray)
    items: dict[str, _Message] = field(default_factory=dict)


# ---- the byte source ----


class _Source:
    """Bytes from ``open_at``, read forward: small reads are buffered, long skips reopen the source."""

    def __init__(self, open_at: OpenAt, seek_bytes: int) -> None:
        self._open_at = open_at
        self._seek_bytes = seek_bytes
        self._chunks: AsyncIterator[bytes] | None = None
        self._buffer = memoryview(b"")
        self._at = 0  # next unread index in _buffer
        self.offset = 0  # absolute offset of the next unread byte

    async def close(self) -> None:
        chunks, self._chunks = self._chunks, None
        close = getattr(chunks, "aclose", None)
        if close is not None:
            await close()

    async def _fill(self) -> None:
        if self._chunks is None:
            self._chunks = self._open_at(self.offset)
        while True:
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                raise _Malformed("truncated message") from None
            if chunk:
                self._buffer, self._at = memoryview(chunk), 0
                return

    def _available(self) -> int:
        return len(self._buffer) - self._at

    async def byte(self) -> int:
        if not self._available():
            await self._fill()
        value = self._buffer[self._at]
        self._at += 1
        self.offset += 1
        return value

    async def varint(self) -> int:
        """An unsigned varint of at most 10 bytes (64 bits)."""
        buffer, at = self._buffer, self._at
        if len(buffer) - at >= 10:  # the common case, decoded without an await per byte
            result = shift = 0
            while shift < 70:
                b = buffer[at]
                at += 1
                result |= (b & 0x7F) << shift
                if not b & 0x80:
                    self.offset += at - self._at
                    self._at = at
                    return result & 0xFFFF_FFFF_FFFF_FFFF
                shift += 7
            raise _Malformed("a varint is longer than 10 bytes")
        result = 0
        for shift in range(0, 70, 7):
            b = await self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result & 0xFFFF_FFFF_FFFF_FFFF
        raise _Malformed("a varint is longer than 10 bytes")

    async def pieces(self, n: int) -> AsyncIterator[memoryview]:
        """The next ``n`` bytes as views of the chunks they are in (valid until the next read)."""
        while n:
            if not self._available():
                await self._fill()
            take = min(n, self._available())
            piece = self._buffer[self._at : self._at + take]
            self._at += take
            self.offset += take
            n -= take
            yield piece

    async def take(self, n: int) -> bytes:
        if n <= self._available():
            data = bytes(self._buffer[self._at : self._at + n])
            self._at += n
            self.offset += n
            return data
        return b"".join([bytes(piece) async for piece in self.pieces(n)])

    async def skip(self, n: int) -> None:
        if n <= self._available():
            self._at += n
            self.offset += n
            return
        if n - self._available() > self._seek_bytes:
            # Reopen past the skipped bytes: a model's tensor data need not be read to be skipped.
            await self.close()
            self._buffer, self._at = memoryview(b""), 0
            self.offset += n
            return
        async for _ in self.pieces(n):
            pass


# ---- the wire format ----


async def _tag(source: _Source, *, in_group: bool = False) -> tuple[int, int]:
    key = await source.varint()
    number, wire_type = key >> 3, key & 7
    # upb skips an unknown group's contents without refusing field number 0 in them.
    if (number == 0 and not in_group) or number > 0x1FFF_FFFF:
        raise _Malformed(f"invalid field number {number}")
    return number, wire_type


async def _length(source: _Source, end: int) -> int:
    n = await source.varint()
    if n > end - source.offset:
        raise _Malformed("truncated message (a length runs past its end)")
    return n


async def _end_of(source: _Source, end: int) -> int:
    """Reads a length and returns where the field it prefixes ends."""
    n = await _length(source, end)
    return source.offset + n


async def _skip_field(source: _Source, number: int, wire_type: int, end: int, depth: int) -> None:
    if wire_type == _VARINT:
        await source.varint()
    elif wire_type == _I64:
        await _skip_fixed(source, 8, end)
    elif wire_type == _I32:
        await _skip_fixed(source, 4, end)
    elif wire_type == _LEN:
        await source.skip(await _length(source, end))
    elif wire_type == _SGROUP:
        if depth >= _DEPTH:
            raise _Malformed("nested too deeply")
        while True:
            if source.offset >= end:
                raise _Malformed("truncated group")
            inner, inner_type = await _tag(source, in_group=True)
            if inner_type == _EGROUP:
                if inner != number:
                    raise _Malformed("mismatched end of group")
                return
            await _skip_field(source, inner, inner_type, end, depth + 1)
    else:  # a stray end-group, or wire types 6 and 7
        raise _Malformed(f"invalid wire type {wire_type}")
    if source.offset > end:
        raise _Malformed("truncated message")


async def _skip_fixed(source: _Source, n: int, end: int) -> None:
    if n > end - source.offset:
        raise _Malformed("truncated message")
    await source.skip(n)


async def _string(source: _Source, end: int, what: str) -> str:
    raw = await source.take(await _length(source, end))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _Malformed(f"{what} is not valid UTF-8") from None


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


async def _parse_dxo(source: _Source, end: int, message: _Message, depth: int, tally: _Tally) -> None:
    if depth >= _DEPTH:
        raise _Malformed("nested too deeply")
    while source.offset < end:
        number, wire_type = await _tag(source)
        if number == 1 and wire_type == _VARINT:
            message.kind = _int32(await source.varint())
        elif number == 2 and wire_type == _LEN:
            tensor = _Tensor()

            async def tensor_value(value_end: int, tensor: _Tensor = tensor) -> None:
                await _parse_tensor(source, value_end, tensor)

            name = await _map_entry(source, await _end_of(source, end), tensor_value, depth)
            if name is not None:
                # Counted as they come, so that no more than the limit is ever kept (a repeated key
                # replaces its entry, as in the runtime's map).
                tally.count(tensors=int(name not in message.tensors))
                message.tensors[name] = tensor
        elif number == 3 and wire_type == _LEN:
            entry = await source.take(await _length(source, end))
            message.meta += _encode_varint(3 << 3 | _LEN) + _encode_varint(len(entry)) + entry
        elif number == 4 and wire_type == _LEN:
            item = _Message()

            async def item_value(value_end: int, item: _Message = item) -> None:
                await _parse_dxo(source, value_end, item, depth + 1, tally)

            name = await _map_entry(source, await _end_of(source, end), item_value, depth)
            if name is not None:
                tally.count(items=int(name not in message.items))
                message.items[name] = item
        else:
            await _skip_field(source, number, wire_type, end, depth)
    _check_end(source, end)


async def _map_entry(
    source: _Source, end: int, parse_value: Callable[[int], Awaitable[None]], depth: int
) -> str | None:
    """Reads a map entry (key 1, value 2, each possibly repeated); returns its key, None if it is dropped.

    An entry with unknown fields of its own goes to the message's unknown fields (upb), not the map.
    """
    key, unknown = "", False
    while source.offset < end:
        number, wire_type = await _tag(source)
        if number == 1 and wire_type == _LEN:
            key = await _string(source, end, "a map key")
        elif number == 2 and wire_type == _LEN:
            await parse_value(await _end_of(source, end))
        else:
            await _skip_field(source, number, wire_type, end, depth + 1)
            unknown = True
    _check_end(source, end)
    return None if unknown else key


def _check_end(source: _Source, end: int) -> None:
    if source.offset != end:
        raise _Malformed("truncated message (a field runs past its end)")


def _int32(value: int) -> int:
    value &= 0xFFFF_FFFF  # an enum is an int32 on the wire, sign-extended to 10 bytes when negative
    return value - (1 << 32) if value >= 1 << 31 else value


async def _parse_tensor(source: _Source, end: int, tensor: _Tensor) -> None:
    while source.offset < end:
        number, wire_type = await _tag(source)
        if number == 1 and wire_type == _LEN:
            tensor.dtype = await _string(source, end, "a dtype")
        elif number == 2 and wire_type == _VARINT:
            tensor.shape.append(_int64(await source.varint()))
        elif number == 2 and wire_type == _LEN:  # packed
            packed_end = await _end_of(source, end)
            while source.offset < packed_end:
                tensor.shape.append(_int64(await source.varint()))
            _check_end(source, packed_end)
        elif 3 <= number <= 5 and wire_type == _LEN:
            encoding = (TensorEncoding.DENSE, TensorEncoding.FLOAT16, TensorEncoding.SPARSE)[number - 3]
            if tensor.encoding is not encoding:  # another member of the oneof clears the one set
                tensor.encoding = encoding
                tensor.data_bytes = tensor.values_bytes = 0
                tensor.indices = _Indices()
            await _parse_encoding(source, await _end_of(source, end), tensor)
        else:
            await _skip_field(source, number, wire_type, end, 0)
    _check_end(source, end)


async def _parse_encoding(source: _Source, end: int, tensor: _Tensor) -> None:
    sparse = tensor.encoding is TensorEncoding.SPARSE
    while source.offset < end:
        number, wire_type = await _tag(source)
        if number == 1 and wire_type == _LEN and not sparse:
            tensor.data_bytes = n = await _length(source, end)
            await source.skip(n)
        elif number == 1 and wire_type == _LEN:
            tensor.indices = await _scan_indices(source, await _length(source, end))
        elif number == 2 and wire_type == _LEN and sparse:
            tensor.values_bytes = n = await _length(source, end)
            await source.skip(n)
        else:
            await _skip_field(source, number, wire_type, end, 0)
    _check_end(source, end)


async def _scan_indices(source: _Source, n: int) -> _Indices:
    """Streams over sparse indices, keeping the first, the last and the first that is out of order."""
    found = _Indices(length=n)
    carry = b""
    position = 0  # index of the next int64
    previous: int | None = None
    async for piece in source.pieces(n):
        raw = carry + bytes(piece) if carry else piece
        whole = len(raw) - len(raw) % _INDEX.itemsize
        carry = bytes(raw[whole:])
        if not whole:
            continue
        values = np.frombuffer(raw[:whole], dtype=_INDEX)
        if previous is None:
            found.first = int(values[0])
        elif found.disorder is None and values[0] <= previous:
            found.disorder = (position, int(values[0]), previous)
        if found.disorder is None and values.size > 1:
            steps = np.flatnonzero(values[1:] <= values[:-1])
            if steps.size:
                at = int(steps[0])
                found.disorder = (position + at + 1, int(values[at + 1]), int(values[at]))
        previous = found.last = int(values[-1])
        position += values.size
    return found


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


# ---- the checks DXO.from_proto makes ----


def _finish(message: _Message, path: str, max_elements: int, tally: _Tally) -> DxoOutline:
    kind = _kind(message.kind, path)
    if message.items and kind != DataKind.COLLECTION:
        raise InvalidArgument(f"{_where(path)}items are only for COLLECTION, not {kind}")
    tensors = {
        name: _finish_tensor(tensor, path + name, max_elements) for name, tensor in message.tensors.items()
    }
    meta_message = dxo_pb2.Dxo()
    try:
        meta_message.ParseFromString(bytes(message.meta))
    except DecodeError as exc:
        raise InvalidArgument(f"DXO bytes are not a valid fedlink.v1.Dxo message: {exc}") from None
    tally.count_meta(meta_message.meta)
    meta = {key: _read_meta(value, path + key) for key, value in meta_message.meta.items()}
    items = {
        name: _finish(item, f"{path}{name}/", max_elements, tally) for name, item in message.items.items()
    }
    return DxoOutline(kind=kind, tensors=tensors, meta=meta, items=items)


def _kind(value: int, path: str) -> DataKind:
    kind = _KIND_FROM_PROTO.get(value)
    if kind is None:
        raise InvalidArgument(
            f"{_where(path)}unknown or unspecified kind {value}; expected one of {', '.join(DataKind)}"
        )
    return kind


def _finish_tensor(tensor: _Tensor, name: str, max_elements: int) -> TensorOutline:
    count = element_count(tensor.dtype, tensor.shape, name=name, max_elements=max_elements)
    encoding = tensor.encoding
    if encoding is None:
        raise InvalidArgument(f"{_label(name)}no encoding set (expected one of dense, float16, sparse)")
    itemsize = dtypes.wire_dtype(tensor.dtype).itemsize
    if encoding is TensorEncoding.DENSE:
        _check_length(tensor.data_bytes, count * itemsize, "dense data", name, f"{count} × {itemsize}")
    elif encoding is TensorEncoding.FLOAT16:
        if tensor.dtype not in FLOAT_DTYPES:
            raise InvalidArgument(
                f"{_label(name)}float16 encoding is only for float dtypes, not {tensor.dtype}"
            )
        _check_length(tensor.data_bytes, count * 2, "float16 data", name, f"{count} × 2")
    else:
        _check_sparse(tensor, count, itemsize, name)
    return TensorOutline(dtype=tensor.dtype, shape=tuple(tensor.shape), encoding=encoding)


def _check_sparse(tensor: _Tensor, count: int, itemsize: int, name: str) -> None:
    indices = tensor.indices
    if indices.length % _INDEX.itemsize:
        raise InvalidArgument(
            f"{_label(name)}sparse indices are {indices.length} bytes, not a multiple of 8 (int64)"
        )
    k = indices.length // _INDEX.itemsize
    _check_length(tensor.values_bytes, k * itemsize, "sparse values", name, f"{k} indices × {itemsize}")
    if not k:
        return
    if indices.first < 0 or indices.last >= count:
        bad = indices.first if indices.first < 0 else indices.last
        raise InvalidArgument(f"{_label(name)}sparse index {bad} is out of range [0, {count})")
    check_sparse_count(k, count, name)
    if indices.disorder is not None:
        at, value, previous = indices.disorder
        raise InvalidArgument(
            f"{_label(name)}sparse indices must be strictly increasing; "
            f"position {at} holds {value} after {previous}"
        )


def _check_length(actual: int, expected: int, what: str, name: str, formula: str) -> None:
    if actual != expected:
        raise InvalidArgument(f"{_label(name)}{what} is {actual} bytes; expected {expected} ({formula})")


def _label(name: str) -> str:
    return f"tensor {name!r}: " if name else "tensor: "


def _where(path: str) -> str:
    return f"DXO item {path.rstrip('/')!r}: " if path else "DXO: "
