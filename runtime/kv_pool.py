"""Paged KV memory: fixed-size blocks of 16 tokens from one pool per model.

Each layer's keys live in one array `[Hkv, Dh, n_blocks * 16]` (values `[Hkv, n_blocks*16,
Dh]`), so a run of consecutive blocks is a zero-copy view that attention can use directly
with one matmul. A sequence holds a block table; attention walks its maximal runs of
consecutive blocks (usually one or two: a shared cached prefix, then its own blocks), so
paging costs a few extra small ops instead of a gather of the whole cache per layer.

The arrays are anonymous memory maps with transparent huge pages turned off, so the
operating system backs only the 4 KiB pages that blocks have been written to: resident KV
memory grows with the tokens in use (lowest free blocks are handed out first), not with
max context x max sequences. (numpy asks for huge pages on large arrays; with the keys'
transposed layout one token would then make whole 2 MiB pages of every row resident.)
"""

from __future__ import annotations

import heapq
import mmap
from collections.abc import Iterable

import numpy as np

from runtime.errors import LLMQRuntimeError

BLOCK_SIZE = 16


class OutOfBlocksError(LLMQRuntimeError):
    """The pool has no free block left (the scheduler preempts a sequence and retries)."""


class BlockPool:
    """The KV blocks of one model: storage, a free list and a reference count per block."""

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_blocks: int,
        block_size: int = BLOCK_SIZE,
    ) -> None:
        if n_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {n_blocks}")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.n_blocks, self.block_size = n_blocks, block_size
        tokens = n_blocks * block_size
        self.keys = [_lazy_array((n_kv_heads, head_dim, tokens)) for _ in range(n_layers)]
        self.values = [_lazy_array((n_kv_heads, tokens, head_dim)) for _ in range(n_layers)]
        self.refcount = np.zeros(n_blocks, np.int32)
        self._free = list(range(n_blocks))  # a heap: lowest ids first keeps touched pages dense
        self._free_set = set(self._free)

    @classmethod
    def for_budget(
        cls, n_layers: int, n_kv_heads: int, head_dim: int, memory_bytes: int
    ) -> BlockPool:
        per_block = n_layers * 2 * n_kv_heads * head_dim * BLOCK_SIZE * 4
        return cls(n_layers, n_kv_heads, head_dim, max(1, memory_bytes // per_block))

    @property
    def block_nbytes(self) -> int:
        return self.n_layers * 2 * self.n_kv_heads * self.head_dim * self.block_size * 4

    @property
    def n_free(self) -> int:
        return len(self._free_set)

    @property
    def bytes_in_use(self) -> int:
        return (self.n_blocks - self.n_free) * self.block_nbytes

    def allocate(self, after: int | None = None) -> int:
        """One free block with refcount 1; the one right after `after` when it is free."""
        if after is not None and after + 1 in self._free_set:
            block = after + 1
            self._free_set.discard(block)  # stays in the heap; skipped when popped
        else:
            block = self._pop_free()
        self.refcount[block] = 1
        return block

    def retain(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.refcount[block] += 1

    def release(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list."""
        for block in blocks:
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self._free_set.add(block)
                heapq.heappush(self._free, block)

    def _pop_free(self) -> int:
        while self._free:
            block = heapq.heappop(self._free)
            if block in self._free_set:
                self._free_set.discard(block)
                return block
        raise OutOfBlocksError(f"all {self.n_blocks} KV blocks are in use")


def _lazy_array(shape: tuple[int, ...]) -> np.ndarray:
    """float32 zeros backed by an anonymous map: pages become resident when first written."""
    buffer = mmap.mmap(-1, int(np.prod(shape)) * 4)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buffer, np.float32).reshape(shape)


class PagedKVCache:
    """One sequence's view of the pool: a block table and the positions written so far.

    Implements the cache protocol the models call (`update_and_fetch`, `length`, `nbytes`).
    `reserve` must have made room before a forward pass writes; it raises
    `OutOfBlocksError` when the pool is exhausted, before anything is written.
    """

    def __init__(self, pool: BlockPool, shared_prefix: list[int] | None = None) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0
        self._runs: list[tuple[int, int]] = []  # (first block, number of blocks) per run
        if shared_prefix:
            pool.retain(shared_prefix)
            for block in shared_prefix:
                self._append_block(block)
            self.length = len(shared_prefix) * pool.block_size

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.pool.block_size

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.pool.block_nbytes

    def reserve(self, n_tokens: int) -> None:
        """Own enough blocks for `n_tokens` positions; all or nothing."""
        added: list[int] = []
        try:
            while self.capacity < n_tokens:
                last = self.blocks[-1] if self.blocks else None
                block = self.pool.allocate(after=last)
                added.append(block)
                self._append_block(block)
        except OutOfBlocksError:
            self._drop_tail(len(added))
            self.pool.release(added)
            raise

    def release(self) -> None:
        """Give every block back (shared ones lose one reference)."""
        self.pool.release(self.blocks)
        self.blocks, self._runs, self.length = [], [], 0

    def update_and_fetch(
        self, layer: int, start: int, keys: np.ndarray, values: np.ndarray
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Store `[n, Hkv, Dh]` keys/values at positions `start..start+n`.

        Returns the cache up to `start + n` as segments `(keys [Hkv, Dh, l], values [Hkv, l,
        Dh])` in position order, one per run of consecutive blocks. (Batched forward passes
        write every sequence's slots at once instead: see runtime/models/attention.py.)
        """
        end = start + keys.shape[0]
        pool_k, pool_v = self.pool.keys[layer], self.pool.values[layer]
        slots = self.slot_ids(start, end)
        pool_k[:, :, slots] = keys.transpose(1, 2, 0)  # [n, Hkv, Dh] -> [Hkv, Dh, n]
        pool_v[:, slots] = values.transpose(1, 0, 2)  # -> [Hkv, n, Dh]
        return [(pool_k[:, :, a : a + n], pool_v[:, a : a + n]) for a, n in self.runs(0, end)]

    def slot_ids(self, start: int, end: int) -> np.ndarray:
        """The pool slot of each position `start..end-1`; they must have been reserved."""
        if end > self.capacity:
            raise OutOfBlocksError(f"reserve {end} positions before writing them")
        bs = self.pool.block_size
        positions = np.arange(start, end)
        return np.asarray(self.blocks)[positions // bs] * bs + positions % bs

    def runs(self, first: int, end: int) -> list[tuple[int, int]]:
        """Positions `first..end-1` as (first slot, count) runs of consecutive slots."""
        bs = self.pool.block_size
        out, covered = [], 0  # covered: positions before the current run
        for block, count in self._runs:
            lo, hi = max(first, covered), min(end, covered + count * bs)
            if lo < hi:
                out.append((block * bs + lo - covered, hi - lo))
            covered += count * bs
            if covered >= end:
                break
        return out

    def _append_block(self, block: int) -> None:
        self.blocks.append(block)
        if self._runs and self._runs[-1][0] + self._runs[-1][1] == block:
            first, count = self._runs[-1]
            self._runs[-1] = (first, count + 1)
        else:
            self._runs.append((block, 1))

    def _drop_tail(self, n: int) -> None:
        for _ in range(n):
            self.blocks.pop()
            first, count = self._runs[-1]
            if count == 1:
                self._runs.pop()
            else:
                self._runs[-1] = (first, count - 1)
