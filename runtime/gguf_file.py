"""Open a GGUF file and hand out its metadata and its tensors as float32 arrays.

runtime/gguf_header.py reads the header, the `gguf` package dequantizes; this module turns
their failures into one-line errors that name the file, and lays tensors out the way the model
code wants them (numpy row-major, `[rows, cols]` = GGUF `ne` reversed).
"""

from __future__ import annotations

import functools
import os
import struct
import weakref
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from runtime.cache_dir import file_digest
from runtime.errors import ModelFormatError
from runtime.gguf_header import GGUFHeader, TensorInfo

_MAGIC = b"GGUF"
CONTENT_DIGEST = "sha256"  # `GGUFFile.content_key`'s algorithm
EXPERT_MARK = "#"  # "blk.0.ffn_up_exps.weight#3": expert 3's slice, a tensor of its own


def expert_tensor(name: str, expert: int) -> str:
    """The name every GGUFFile method takes for expert `expert`'s `[out, in]` slice of the
    3-D expert tensor `name` (`ffn_up_exps`: `[E, out, in]`)."""
    return f"{name}{EXPERT_MARK}{expert}"


class GGUFFile:
    """A parsed GGUF file: metadata as plain Python values, tensors dequantized on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        header = _read_header(self.path)
        self._tensors = header.tensors
        self.metadata: dict[str, Any] = header.metadata

    def content_key(self) -> str | None:
        """Names what this file's tensors hold, for what is built from them and kept
        (runtime/kernels/prepared.py): the file's digest. A view that changes tensors
        returns its own key, or None to keep nothing. SHA-256: twice blake2b's speed here
        (SHA extensions), and the digest runtime/hub.py checked a download by."""
        return file_digest(self.path, CONTENT_DIGEST)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFormatError(f"{self.path.name}: metadata has no general.architecture")
        return arch

    def arch_value(self, key: str, default: Any = None) -> Any:
        """Metadata value under the architecture's prefix, e.g. `llama.block_count`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.arch_value(key)
        if value is None:
            raise ModelFormatError(f"{self.path.name}: metadata lacks {self.architecture}.{key}")
        return value

    def linear_rope_scale(self) -> float:
        """Position divisor for linear rope scaling; 1.0 when the model declares none."""
        kind = self.arch_value("rope.scaling.type", "none")
        if kind == "none":
            return 1.0
        if kind != "linear":
            raise ModelFormatError(f"{self.path.name}: rope scaling {kind!r} is not supported")
        return float(self.arch_value("rope.scaling.factor", 1.0))

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float32, shape `ne` reversed (for a weight: `[out, in]`)."""
        info = self._info(name)
        return self._dequantize(name, info.data, info.tensor_type).reshape(info.shape)

    def rows(self, name: str, index: np.ndarray | slice) -> np.ndarray:
        """Some rows of a 2-D tensor as float32 `[n, cols]`, dequantizing only those. Rows
        picked by index (embedding lookups, a rescored head's candidates) are read from the
        file, not the mapping: each fault on a mapped file maps a whole run of neighbouring
        pages, so 2,000 scattered rows of Gemma 3's embedding grew the resident set by 243
        MiB where they hold 1.3 (MADV_RANDOM did not change it, kernel 6.18)."""
        info = self._info(name)
        raw = info.data[index] if isinstance(index, slice) else self._read_rows(info, index)
        values = self._dequantize(name, raw, info.tensor_type)
        return values.reshape(-1, info.shape[-1])

    def _read_rows(self, info: TensorInfo, index: np.ndarray) -> np.ndarray:
        ids = np.asarray(index, dtype=np.int64).reshape(-1)
        data = info.data
        if len(ids) and (ids.min() < 0 or ids.max() >= len(data)):
            raise IndexError(f"{info.name}: row index out of range 0..{len(data) - 1}")
        out = np.empty((len(ids), *data.shape[1:]), data.dtype)
        row_bytes = data.strides[0]
        for i, row in enumerate(ids.tolist()):
            at = info.offset + row * row_bytes
            if os.preadv(self._fd, [out[i].view(np.uint8)], at) != row_bytes:
                raise ModelFormatError(f"{self.path.name}: {info.name} ends before its rows")
        return out

    @functools.cached_property
    def _fd(self) -> int:
        """A descriptor for reading rows, opened at the first lookup and closed with the
        object: a decode step looks rows up once or twice, and needs no open of its own."""
        fd = os.open(self.path, os.O_RDONLY)
        weakref.finalize(self, os.close, fd)
        return fd

    def _info(self, name: str) -> TensorInfo:
        info = self._tensors.get(name)
        if info is None and EXPERT_MARK in name:
            return self._expert_info(*name.rsplit(EXPERT_MARK, 1))
        if info is None:
            raise ModelFormatError(f"{self.path.name}: tensor {name!r} is missing")
        return info

    def _expert_info(self, name: str, expert: str) -> TensorInfo:
        """One expert's `[out, in]` of a 3-D expert tensor `[E, out, in]`, a view of its
        blocks: each expert is a weight of its own, kept in the file's type."""
        info = self._info(name)
        e = int(expert)
        if len(info.shape) != 3 or not 0 <= e < info.shape[0]:
            raise ModelFormatError(
                f"{self.path.name}: tensor {name!r} of shape {list(info.shape)} has no expert {e}"
            )
        data = info.data[e]
        return TensorInfo(
            name + EXPERT_MARK + expert,
            info.shape[1:],
            info.tensor_type,
            data,
            info.offset + e * info.data.strides[0],
        )

    def _dequantize(self, name: str, data: np.ndarray, qtype) -> np.ndarray:
        try:
            if qtype == gguf.GGMLQuantizationType.F32:
                values = np.asarray(data, dtype=np.float32)
            else:
                values = gguf.quants.dequantize(data, qtype)
        except NotImplementedError as exc:
            raise ModelFormatError(
                f"{self.path.name}: tensor {name!r} has type {qtype.name}, "
                "which this gguf version cannot dequantize"
            ) from exc
        return values.astype(np.float32, copy=False)

    def blocks(self, name: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType, tuple[int, ...]]:
        """The tensor as stored: raw data (a view of the mapped file), its GGML type, and its
        shape `ne` reversed; for backends that keep weights in their quantized form."""
        info = self._info(name)
        return info.data, info.tensor_type, info.shape


def _read_header(path: Path) -> GGUFHeader:
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such file")
    with path.open("rb") as handle:
        if handle.read(4) != _MAGIC:
            raise ModelFormatError(f"{path.name}: not a GGUF file (bad magic)")
    try:
        return GGUFHeader(path)
    except (ValueError, IndexError, OSError, KeyError, TypeError, struct.error) as exc:
        raise ModelFormatError(f"{path.name}: corrupt or truncated GGUF file ({exc})") from exc
