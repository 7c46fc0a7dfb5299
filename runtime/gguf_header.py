"""Read a GGUF file's header (metadata and tensor table) in one pass over a bytes view.

gguf-py's `GGUFReader` builds a numpy view for every value of every metadata array: for a
vocabulary of 49k tokens and 49k merges that took 1.2-3 s, and 10-24 s for Gemma's 262k
tokens, against llama.cpp's 0.1 s load. The format is a flat sequence of little-endian
scalars, length-prefixed strings and typed arrays, so reading it here with `struct` and
`np.frombuffer` takes tens of milliseconds. The values are those `ReaderField.contents()`
gives (tests/runtime/test_gguf_header.py compares both on the real files), and tensor data
is laid out as gguf-py lays it out, so `gguf.quants.dequantize` reads it unchanged.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

VT = gguf.GGUFValueType
_SCALARS: dict[int, tuple[str, Any]] = {
    VT.UINT8: ("<B", np.uint8),
    VT.INT8: ("<b", np.int8),
    VT.UINT16: ("<H", np.uint16),
    VT.INT16: ("<h", np.int16),
    VT.UINT32: ("<I", np.uint32),
    VT.INT32: ("<i", np.int32),
    VT.FLOAT32: ("<f", np.float32),
    VT.BOOL: ("<?", np.bool_),
    VT.UINT64: ("<Q", np.uint64),
    VT.INT64: ("<q", np.int64),
    VT.FLOAT64: ("<d", np.float64),
}
# element types gguf-py hands out typed; every other (quantized) type comes as bytes
_TYPED_TENSORS = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
    gguf.GGMLQuantizationType.I8: np.int8,
    gguf.GGMLQuantizationType.I16: np.int16,
    gguf.GGMLQuantizationType.I32: np.int32,
    gguf.GGMLQuantizationType.I64: np.int64,
}
DEFAULT_ALIGNMENT = 32


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # `ne` reversed: numpy order, `[rows, cols]` for a weight
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray  # a view of the mapped file, laid out as gguf-py lays it out
    offset: int  # where `data` starts in the file (rows are read from there by index)


class GGUFHeader:
    """Metadata as plain Python values and the tensor table, over a read-only mapping."""

    def __init__(self, path: Path) -> None:
        self.mapped = np.memmap(path, mode="r").view(np.ndarray)  # plain slicing, no overhead
        self._buf = memoryview(self.mapped)
        self._offset = 0
        magic, version = self._unpack("<II")
        if magic != gguf.GGUF_MAGIC:
            raise ValueError("bad magic")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3 are)")
        n_tensors, n_kv = self._unpack("<QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            (value_type,) = self._unpack("<I")
            self.metadata[key] = self._value(value_type)
        table = [self._tensor_entry() for _ in range(n_tensors)]
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self._offset // alignment) * alignment
        self.tensors = {name: self._tensor(name, *entry, data_start) for name, *entry in table}

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._buf, self._offset)
        self._offset += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._buf, self._offset)
        start = self._offset + 8
        self._offset = start + length
        if self._offset > len(self._buf):
            raise ValueError("string runs past the end of the file")
        return str(self._buf[start : self._offset], "utf-8")

    def _strings(self, count: int) -> list[str]:
        """`count` strings in a row: a vocabulary's 262k tokens, in one tight loop."""
        buf, offset, end, strings = self._buf, self._offset, len(self._buf), []
        length_at = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (length,) = length_at(buf, offset)
            offset += 8 + length
            if offset > end:
                raise ValueError("string runs past the end of the file")
            strings.append(str(buf[offset - length : offset], "utf-8"))
        self._offset = offset
        return strings

    def _value(self, value_type: int) -> Any:
        if value_type == VT.STRING:
            return self._string()
        if value_type in _SCALARS:
            return self._unpack(_SCALARS[value_type][0])[0]
        if value_type == VT.ARRAY:
            item_type, count = self._unpack("<IQ")
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder("<")
                items = np.frombuffer(self._buf, dtype, count, self._offset)
                self._offset += items.nbytes
                return items.tolist()
            if item_type == VT.STRING:
                return self._strings(count)
            return [self._value(item_type) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {value_type}")

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        (n_dims,) = self._unpack("<I")
        dims = self._unpack(f"<{n_dims}Q")
        tensor_type, offset = self._unpack("<IQ")
        return name, tuple(reversed(dims)), tensor_type, offset

    def _tensor(
        self, name: str, shape: tuple[int, ...], raw_type: int, offset: int, data_start: int
    ) -> TensorInfo:
        qtype = gguf.GGMLQuantizationType(raw_type)
        start = data_start + offset
        if qtype in _TYPED_TENSORS:
            dtype = np.dtype(_TYPED_TENSORS[qtype])
            count = int(np.prod(shape))
            data = self.mapped[start : start + count * dtype.itemsize].view(dtype).reshape(shape)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
            data = self.mapped[start : start + int(np.prod(byte_shape))].reshape(byte_shape)
        return TensorInfo(name, shape, qtype, data, start)
