"""Per-sequence key/value cache, preallocated and grown in fixed steps.

Layers call `update_and_fetch` with the keys and values of the new tokens and get back
everything the sequence has so far. Growth happens in whole steps (never per token), so
decode does not reallocate on most steps.
"""

from __future__ import annotations

import numpy as np

GROWTH_STEP = 256


class KVCache:
    """Keys and values of one sequence for every layer.

    Keys are stored transposed, `[Hkv, Dh, capacity]`, so that attention scores are a plain
    matmul `q @ K` (3x faster than a transposed operand for single-token decode); values
    are `[Hkv, capacity, Dh]`.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        step: int = GROWTH_STEP,
    ) -> None:
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.max_tokens = max_tokens
        self.step = step
        self.length = 0  # tokens stored in every layer once a forward pass completes
        self._capacity = 0
        self._keys: list[np.ndarray] = []
        self._values: list[np.ndarray] = []

    @property
    def capacity(self) -> int:
        return self._capacity

    def reserve(self, n_tokens: int) -> None:
        """Make room for `n_tokens` in total, rounding up to whole growth steps."""
        if n_tokens <= self._capacity:
            return
        if n_tokens > self.max_tokens:
            raise ValueError(f"KV cache holds at most {self.max_tokens} tokens, asked {n_tokens}")
        new_capacity = min(self.max_tokens, -(-n_tokens // self.step) * self.step)
        key_shape = (self.n_kv_heads, self.head_dim, new_capacity)
        value_shape = (self.n_kv_heads, new_capacity, self.head_dim)
        keys = [np.empty(key_shape, np.float32) for _ in range(self.n_layers)]
        values = [np.empty(value_shape, np.float32) for _ in range(self.n_layers)]
        n = self.length  # nothing to copy on first use: the old lists are empty
        for old, new in zip(self._keys, keys, strict=False):
            new[:, :, :n] = old[:, :, :n]
        for old, new in zip(self._values, values, strict=False):
            new[:, :n] = old[:, :n]
        self._keys, self._values, self._capacity = keys, values, new_capacity

    def commit(self, length: int) -> None:
        """A forward pass stored positions up to `length`."""
        self.length = length

    def update_and_fetch(
        self, layer: int, start: int, keys: np.ndarray, values: np.ndarray
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Store `[n, Hkv, Dh]` keys/values at positions `start..start+n`.

        Returns the cache so far as one segment: keys `[Hkv, Dh, L]`, values `[Hkv, L, Dh]`
        (the paged cache returns one segment per run of consecutive blocks).
        """
        end = start + keys.shape[0]
        self.reserve(end)
        self._keys[layer][:, :, start:end] = keys.transpose(1, 2, 0)  # -> [Hkv, Dh, n]
        self._values[layer][:, start:end] = values.transpose(1, 0, 2)  # -> [Hkv, n, Dh]
        return [(self._keys[layer][:, :, :end], self._values[layer][:, :end])]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._keys + self._values)
