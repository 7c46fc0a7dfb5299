"""Paged KV memory: fixed-size blocks of 16 tokens from one pool per model.

Each layer's keys and values live in one array each, `[Hkv, n_blocks * 16, Dh]`, so a run
of consecutive blocks is a zero-copy view that attention uses directly with one matmul. A
sequence holds a block table; attention walks its maximal runs of consecutive blocks, so
paging costs a few extra small ops instead of a gather of the whole cache per layer.

Runs stay few because the allocator keeps each sequence's blocks consecutive: a sequence
grows into the block right after its last one, and a sequence that needs a block elsewhere
(a new one, or one that ran into a neighbour) starts in the middle of the largest free gap,
leaving the first half to whoever sits before that gap. Handing out the lowest free block
instead interleaves sequences that decode in step, one 16-token run each, and attention's
cost then grows with every block (measured: 3 runs per sequence after 54 tokens made
attention a third of a 32-sequence step).

Layers that attend over a sliding window (gemma3's local layers) form their own group with
its own blocks and block table: once a sequence moves past a block, no later query of
those layers can see it, so the sequence gives it back at once and those layers hold only
their window. Full-attention layers form group 0; a model without windows has one group.

The arrays are anonymous memory maps with transparent huge pages turned off, so the
operating system backs only the 4 KiB pages that blocks have been written to: one block
of one head is 16 x Dh floats, whole pages for Dh >= 64, so resident KV memory grows with
the blocks written wherever they lie in the pool, not with max context x max sequences.
Pages of freed blocks stay resident (giving them back would cost a system call per block
and head); as runs start at different places over a server's life, resident KV memory can
therefore grow toward the pool's budget (`kv_memory_mb`), never past it.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from runtime.errors import LLMQRuntimeError

BLOCK_SIZE = 16


class OutOfBlocksError(LLMQRuntimeError):
    """The pool has no free block left (the scheduler preempts a sequence and retries)."""


class _BlockGroup:
    """The blocks of the layers that share one attention window: free map and refcounts."""

    def __init__(self, window: int | None, layers: list[int], n_blocks: int) -> None:
        self.window, self.layers = window, layers
        self.refcount = np.zeros(n_blocks, np.int32)
        self.free = np.ones(n_blocks, bool)
        self.n_free = n_blocks

    def allocate(self, after: int | None) -> int:
        if after is not None and after + 1 < len(self.free) and self.free[after + 1]:
            block = after + 1
        else:
            block = self._new_run_start()
        self.free[block] = False
        self.n_free -= 1
        self.refcount[block] = 1
        return block

    def release(self, block: int) -> None:
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self.free[block] = True
            self.n_free += 1

    def _new_run_start(self) -> int:
        """Where a new run of blocks starts: in the largest free gap, at its middle unless
        the gap opens the pool (the half before it is room for the run in front)."""
        if self.n_free == 0:
            raise OutOfBlocksError(f"all {len(self.refcount)} KV blocks are in use")
        edges = np.diff(np.concatenate(([0], self.free.view(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        largest = int(np.argmax(ends - starts))
        start, size = int(starts[largest]), int(ends[largest] - starts[largest])
        return start if start == 0 else start + size // 2


class BlockPool:
    """The KV blocks of one model: storage, and per layer group a free list and refcounts.

    `windows[layer]` is that layer's sliding window (None: full attention). Every group has
    `n_blocks` blocks. Methods without a `group` argument act on group 0.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        n_blocks: int,
        block_size: int = BLOCK_SIZE,
        windows: Sequence[int | None] | None = None,
        storage: Callable[[int, int, int], Any] | None = None,
        value_bytes: int = 4,
        layer_shapes: Sequence[tuple[int, int]] | None = None,
        kv_sources: Sequence[int] | None = None,
    ) -> None:
        """`storage(Hkv, slots, Dh)` makes one layer's keys or values (default: float32
        numpy `[Hkv, slots, Dh]`, backed as written; the tensor ops keep theirs on the
        device in their own layout); `value_bytes` is what one stored value takes;
        `layer_shapes` each layer's own (Hkv, Dh) where they differ (Gemma 4's full layers),
        else every layer's is (`n_kv_heads`, `head_dim`); `kv_sources[i]` the layer whose
        keys and values layer i reads (Gemma 4 E2B/E4B's last layers share earlier ones';
        a layer that is not its own source keeps no storage of its own)."""
        if n_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {n_blocks}")
        windows = list(windows) if windows is not None else [None] * n_layers
        if len(windows) != n_layers:
            raise ValueError(f"{len(windows)} windows given for {n_layers} layers")
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        shapes = list(layer_shapes or [(n_kv_heads, head_dim)] * n_layers)
        if len(shapes) != n_layers:
            raise ValueError(f"{len(shapes)} layer shapes given for {n_layers} layers")
        self.layer_shapes = shapes
        self.kv_sources = list(kv_sources or range(n_layers))
        for i, source in enumerate(self.kv_sources):
            if windows[source] != windows[i] or self.kv_sources[source] != source:
                raise ValueError(f"layer {i} cannot read layer {source}'s keys and values")
        self.n_blocks, self.block_size = n_blocks, block_size
        # full attention first, so that group 0 (the longest-lived blocks) always exists
        order = sorted(set(windows), key=lambda w: (w is not None, w or 0))
        self.groups = [
            _BlockGroup(w, [i for i, lw in enumerate(windows) if lw == w], n_blocks) for w in order
        ]
        self.group_of = [order.index(w) for w in windows]
        self.value_bytes = value_bytes
        tokens = n_blocks * block_size
        storage = storage or (lambda h, t, d: lazy_array((h, t, d)))
        self.keys, self.values = [], []
        for i, (h, d) in enumerate(shapes):
            source = self.kv_sources[i]
            own = source == i
            self.keys.append(storage(h, tokens, d) if own else self.keys[source])
            self.values.append(storage(h, tokens, d) if own else self.values[source])

    @classmethod
    def for_budget(
        cls,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        memory_bytes: int,
        windows: Sequence[int | None] | None = None,
        storage: Callable[[int, int, int], Any] | None = None,
        value_bytes: int = 4,
        layer_shapes: Sequence[tuple[int, int]] | None = None,
        kv_sources: Sequence[int] | None = None,
    ) -> BlockPool:
        shapes = layer_shapes or [(n_kv_heads, head_dim)] * n_layers
        n_blocks = max(1, memory_bytes // kv_block_bytes(shapes, kv_sources, value_bytes))
        return cls(
            n_layers,
            n_kv_heads,
            head_dim,
            n_blocks,
            windows=windows,
            storage=storage,
            value_bytes=value_bytes,
            layer_shapes=layer_shapes,
            kv_sources=kv_sources,
        )

    @property
    def refcount(self) -> np.ndarray:
        return self.groups[0].refcount

    def group_nbytes(self, group: int) -> int:
        """Bytes of one block of one group (its layers only)."""
        return self._nbytes(self.groups[group].layers)

    def _nbytes(self, layers: Iterable[int]) -> int:
        """Bytes of one block of `layers` (those reading another's keys and values: none)."""
        own = [i for i in layers if self.kv_sources[i] == i]
        values = sum(2 * h * d for h, d in (self.layer_shapes[i] for i in own))
        return values * self.block_size * self.value_bytes

    def layer_storage(self, layer: int, window: int | None) -> tuple[int, Any, Any]:
        """`layer`'s group and its keys and values, for a layer attending over `window`
        positions (None: all); a pool that keeps fewer positions for it is refused."""
        group = self.group_of[layer]
        if self.groups[group].window not in (None, window):
            raise ValueError(
                f"layer {layer} attends over {window} positions, its KV pool keeps less"
            )
        return group, self.keys[layer], self.values[layer]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of every layer: the KV memory of `block_size` tokens."""
        return self._nbytes(range(self.n_layers))

    @property
    def n_free(self) -> int:
        return self.groups[0].n_free

    @property
    def bytes_in_use(self) -> int:
        return sum(
            (self.n_blocks - g.n_free) * self.group_nbytes(i) for i, g in enumerate(self.groups)
        )

    def allocate(self, after: int | None = None, group: int = 0) -> int:
        """One free block with refcount 1: the one right after `after` when it is free,
        else the start of a new run (see the module docstring)."""
        return self.groups[group].allocate(after)

    def retain(self, blocks: Iterable[int], group: int = 0) -> None:
        refcount = self.groups[group].refcount
        for block in blocks:
            refcount[block] += 1

    def release(self, blocks: Iterable[int], group: int = 0) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free list."""
        for block in blocks:
            self.groups[group].release(block)


def kv_block_bytes(
    layer_shapes: Sequence[tuple[int, int]],
    kv_sources: Sequence[int] | None = None,
    value_bytes: int = 4,
) -> int:
    """Bytes of one block of `BLOCK_SIZE` tokens: keys and values of every layer `(Hkv,
    Dh)` that keeps its own (`kv_sources`: BlockPool's)."""
    sources = list(kv_sources or range(len(layer_shapes)))
    own = [shape for i, shape in enumerate(layer_shapes) if sources[i] == i]
    return sum(2 * h * d for h, d in own) * BLOCK_SIZE * value_bytes


def _runs_from(runs: list[tuple[int, int, int]], index: int) -> list[tuple[int, int, int]]:
    """Runs (first block, count, table index) cut to the table entries from `index` on."""
    kept = []
    for first, count, at in runs:
        if at + count <= index:
            continue
        cut = max(0, index - at)
        kept.append((first + cut, count - cut, at + cut))
    return kept


def lazy_array(shape: tuple[int, ...], dtype: np.dtype | type = np.float32) -> np.ndarray:
    """Zeros backed by an anonymous map: pages become resident when first written."""
    dtype = np.dtype(dtype)
    buffer = mmap.mmap(-1, int(np.prod(shape)) * dtype.itemsize)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buffer, dtype).reshape(shape)


# One table entry per block of positions, one block id per group; None where a windowed
# group has already given the block back.
SharedBlock = tuple[int | None, ...]


class PagedKVCache:
    """One sequence's view of the pool: a block table per layer group and the positions
    written so far.

    Attention (runtime/models/attention.py) writes and reads the pool through `slot_ids`
    and `runs`; `commit` records what a forward pass wrote. `reserve` must have made room
    before a forward pass writes; it raises `OutOfBlocksError` when the pool is exhausted,
    before anything is written.
    """

    def __init__(self, pool: BlockPool, shared_prefix: Sequence[SharedBlock] | None = None) -> None:
        self.pool = pool
        self.tables: list[list[int | None]] = [[] for _ in pool.groups]
        self.length = 0
        # a hybrid model's per-layer recurrent state (runtime/models/delta_net.py), which
        # its layers keep here beside the blocks: the sequence's, released with them
        self.recurrent: dict[int, Any] = {}
        # per group: (first block, number of blocks, index of the first in the table)
        self._runs: list[list[tuple[int, int, int]]] = [[] for _ in pool.groups]
        for entry in shared_prefix or ():
            for group, block in enumerate(entry):
                if block is not None:
                    pool.retain([block], group)
                self._append_block(group, block)
        self.length = len(shared_prefix or ()) * pool.block_size

    @property
    def capacity(self) -> int:
        return len(self.tables[0]) * self.pool.block_size

    @property
    def nbytes(self) -> int:
        return sum(
            sum(b is not None for b in table) * self.pool.group_nbytes(group)
            for group, table in enumerate(self.tables)
        )

    def shared_blocks(self) -> list[SharedBlock]:
        """The table as one entry per block of positions (what the prefix cache keeps)."""
        return list(zip(*self.tables, strict=True))

    def reserve(self, n_tokens: int) -> None:
        """Own enough blocks for `n_tokens` positions in every group; all or nothing."""
        missing = -(-n_tokens // self.pool.block_size) - len(self.tables[0])
        if missing <= 0:  # most decode steps: the last block has room
            return
        added = [0] * len(self.tables)
        try:
            for _ in range(missing):
                for group, table in enumerate(self.tables):
                    last = table[-1] if table else None
                    self._append_block(group, self.pool.allocate(after=last, group=group))
                    added[group] += 1
        except OutOfBlocksError:
            for group, n in enumerate(added):
                self._drop_tail(group, n)
            raise

    def release(self) -> None:
        """Give every block back (shared ones lose one reference)."""
        for group, table in enumerate(self.tables):
            self.pool.release([b for b in table if b is not None], group)
        self.tables = [[] for _ in self.pool.groups]
        self._runs = [[] for _ in self.pool.groups]
        self.length = 0
        self.recurrent = {}

    def commit(self, length: int) -> None:
        """`length` positions are written; windowed groups give back what no later query
        can see (positions before `length + 1 - window`)."""
        self.length = length
        bs = self.pool.block_size
        for group, table in enumerate(self.tables):
            window = self.pool.groups[group].window
            if window is None:
                continue
            dead = max(0, length + 1 - window) // bs  # blocks wholly before the window
            freed = [b for b in table[:dead] if b is not None]
            if freed:
                self.pool.release(freed, group)
                table[:dead] = [None] * dead
                self._runs[group] = _runs_from(self._runs[group], dead)

    def slot_ids(self, start: int, end: int, group: int = 0) -> np.ndarray:
        """The pool slot of each position `start..end-1`; they must have been reserved."""
        if end > self.capacity:
            raise OutOfBlocksError(f"reserve {end} positions before writing them")
        bs = self.pool.block_size
        positions = np.arange(start, end)
        table = np.asarray(self.tables[group][start // bs : (end - 1) // bs + 1])
        return table[positions // bs - start // bs] * bs + positions % bs

    def runs(self, first: int, end: int, group: int = 0) -> list[tuple[int, int]]:
        """Positions `first..end-1` as (first slot, count) runs of consecutive slots."""
        bs = self.pool.block_size
        out = []
        for block, count, index in self._runs[group]:
            covered = index * bs  # the position the run starts at
            lo, hi = max(first, covered), min(end, covered + count * bs)
            if lo < hi:
                out.append((block * bs + lo - covered, hi - lo))
            if covered + count * bs >= end:
                break
        return out

    def _append_block(self, group: int, block: int | None) -> None:
        table, runs = self.tables[group], self._runs[group]
        index = len(table)
        table.append(block)
        if block is None:
            return
        if runs and runs[-1][0] + runs[-1][1] == block and runs[-1][2] + runs[-1][1] == index:
            first, count, at = runs[-1]
            runs[-1] = (first, count + 1, at)
        else:
            runs.append((block, 1, index))

    def _drop_tail(self, group: int, n: int) -> None:
        """Give back the last `n` blocks of a group's table (a failed reserve)."""
        table, runs = self.tables[group], self._runs[group]
        for _ in range(n):
            self.pool.release([table.pop()], group)
            first, count, at = runs[-1]
            if count == 1:
                runs.pop()
            else:
                runs[-1] = (first, count - 1, at)
