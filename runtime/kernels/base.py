"""What a backend hands the model files: weights that multiply, embeddings that look up.

A fused weight is built from several GGUF tensors (`TensorPart`s, stacked by rows), each
possibly with its rows reordered or scaled (llama's q/k un-interleave, the attention
scale folded into q). Row operations commute with every storage format, so a backend
applies them to whatever it keeps: float32 rows, or int4 codes with their scales.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from runtime.gguf_file import GGUFFile


@dataclass(frozen=True)
class TensorPart:
    """One GGUF tensor `[out, in]` as it goes into a fused weight."""

    name: str
    row_order: np.ndarray | None = None  # new row i is old row row_order[i]
    scale: float = 1.0  # every value times this

    def dense(self, f: GGUFFile) -> np.ndarray:
        """float32 `[out, in]` with the row operations applied."""
        w = f.tensor(self.name)
        if self.row_order is not None:
            w = w[self.row_order]
        if self.scale != 1.0:
            w = w * np.float32(self.scale)
        return w


class Weight(Protocol):
    """A linear weight `[out, in]`: `w(x)` maps `[T, in]` float32 to `[T, out]` float32."""

    shape: tuple[int, int]
    kind: str  # storage and product, e.g. "float32", "int4", "int8"

    def __call__(self, x: np.ndarray) -> np.ndarray: ...

    @property
    def nbytes(self) -> int: ...


class Embedding(Protocol):
    """Token embeddings `[V, D]`: `e(tokens)` gives float32 rows `[T, D]`."""

    shape: tuple[int, int]

    def __call__(self, tokens: np.ndarray) -> np.ndarray: ...

    @property
    def nbytes(self) -> int: ...


class Backend(Protocol):
    name: str

    def loading(self, f: GGUFFile) -> AbstractContextManager[None]:
        """A model's weights are built from `f` inside this (the torch backend reuses and
        keeps weights it prepared, kernels/prepared.py)."""
        ...

    def linear(
        self, f: GGUFFile, parts: list[TensorPart], input_scale: np.ndarray | None = None
    ) -> Weight:
        """Parts stacked by rows into one weight; `input_scale` `[in]` multiplies the input
        first (an RMSNorm weight), folded into the weight where the storage allows."""
        ...

    def embedding(self, f: GGUFFile, name: str) -> Embedding: ...

    def head(self, f: GGUFFile, name: str, tied: Embedding | None = None) -> Weight:
        """The LM head; `tied` is the embedding it shares storage with, if any."""
        ...

    def describe(self) -> dict[str, str]:
        """Which kernel each kind of tensor gets on this machine, for logs and benches."""
        ...

    def stored_bytes(self, f: GGUFFile, name: str, role: str) -> int:
        """Bytes tensor `name` takes once loaded as `role` ("linear", "embedding", "head",
        "tied head" or "vector"), without loading it: what `llmq models` shows."""
        ...
