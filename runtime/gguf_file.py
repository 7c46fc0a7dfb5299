"""Open a GGUF file and hand out its metadata and its tensors as float32 arrays.

The `gguf` package does the parsing and the dequantization; this module only turns its
failures into one-line errors that name the file, and lays tensors out the way the model
code wants them (numpy row-major, `[rows, cols]` = GGUF `ne` reversed).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from runtime.errors import ModelFormatError

_MAGIC = b"GGUF"


class GGUFFile:
    """A parsed GGUF file: metadata as plain Python values, tensors dequantized on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._reader = _open_reader(self.path)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.metadata: dict[str, Any] = {}
        for key, field in self._reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = field.contents()
        # gguf-py keeps a numpy view per vocabulary string (~470 MB for Gemma's 262k
        # tokens); the plain values above are all we need, so free them before the weights.
        self._reader.fields.clear()

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

    def tensor_names(self) -> Iterator[str]:
        return iter(self._tensors)

    def tensor(self, name: str) -> np.ndarray:
        """The tensor as float32, shape `ne` reversed (for a weight: `[out, in]`)."""
        info = self._tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.path.name}: tensor {name!r} is missing")
        shape = tuple(int(n) for n in reversed(info.shape))
        qtype = info.tensor_type
        try:
            if qtype == gguf.GGMLQuantizationType.F32:
                values = np.asarray(info.data, dtype=np.float32)
            else:
                values = gguf.quants.dequantize(info.data, qtype)
        except NotImplementedError as exc:
            raise ModelFormatError(
                f"{self.path.name}: tensor {name!r} has type {qtype.name}, "
                "which this gguf version cannot dequantize"
            ) from exc
        return values.reshape(shape).astype(np.float32, copy=False)

    def tensor_bytes(self) -> int:
        return sum(int(t.n_bytes) for t in self._tensors.values())


def _open_reader(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such file")
    with path.open("rb") as handle:
        if handle.read(4) != _MAGIC:
            raise ModelFormatError(f"{path.name}: not a GGUF file (bad magic)")
    try:
        return gguf.GGUFReader(path, "r")
    except (ValueError, IndexError, OSError, KeyError, TypeError) as exc:
        raise ModelFormatError(f"{path.name}: corrupt or truncated GGUF file ({exc})") from exc
