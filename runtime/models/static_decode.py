"""A decode step over static buffers: what a CUDA graph captures, runnable on any device.

A captured graph replays the same kernels on the same memory, so everything a decode step
reads lives at fixed addresses, sized for a bucket: `rows` sequences (the batch, padded up
to a power of two) and, per KV layer group, `widths` blocks of each row's block table. One
packed int64 buffer holds a step's inputs: token ids, positions, and per group where each
row's table window starts (in positions) and the table itself. The host fills a copy of it
(pinned on a GPU) and the step begins with one copy into the device's.

Attention reads only the blocks in each row's table window: the table's blocks are turned
into pool slots on the device, the keys and values of those slots are gathered into
`[rows, width * 16]`, and one masked `scaled_dot_product_attention` runs over them (the
eager step's decode attention, runtime/models/tensor_attention.py, does the same over its
own padded gather). Padding rows get token 0 at position 0 and a table of the engine's
scratch block: they write their key and value there, attend to it alone, and their logits
are never read.

The step is the model's own `forward` under a `StaticDecodeLayout`: the tensor ops
(tensor_ops.py) see the layout and take their indices from it, so no architecture has a
second forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from runtime.kv_pool import BlockPool
from runtime.models.base import SequenceChunk

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MIN_WIDTH_BLOCKS = 16  # the narrowest table window of full-attention layers: 256 positions


def batch_bucket(rows: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding `rows` sequences; None past the largest."""
    return next((b for b in buckets if b >= rows), None)


def width_buckets(max_blocks: int) -> tuple[int, ...]:
    """Table widths (blocks) of full-attention layers: powers of two from
    MIN_WIDTH_BLOCKS up to the first that holds the model's whole context."""
    widths = [MIN_WIDTH_BLOCKS]
    while widths[-1] < max_blocks:
        widths.append(2 * widths[-1])
    return tuple(widths)


@dataclass(frozen=True)
class Bucket:
    """One graph's shape: batch rows, table width in blocks per KV group, and the LoRA
    passes its rows take (runtime/lora_slots.py: the most adapters a row stacks; 0, a step
    without LoRA rows, has no LoRA products)."""

    rows: int
    widths: tuple[int, ...]
    lora: int = 0

    @property
    def size(self) -> int:
        """int64 values of the packed inputs: tokens, positions, then per group the
        window starts and the table."""
        return self.rows * (2 + len(self.widths) + sum(self.widths))


class StaticDecodeLayout:
    """What the layers see of a static decode step (as `BatchLayout` for the eager step):
    the packed inputs' device views, and per KV group the write slots, gather indices and
    masks, built once per step by `prepare` (tensor_ops.py calls it before any layer)."""

    # a LoRA bucket's rows (runtime/lora_slots.py `SlotRows`), set by the graph runner
    lora = None

    def __init__(self, pool: BlockPool, inputs: torch.Tensor, bucket: Bucket) -> None:
        self.pool, self.bucket = pool, bucket
        self.kv_dtype = pool.keys[0].dtype
        rows = bucket.rows
        self.tokens = inputs[:rows]  # [B]
        self.position_ids = inputs[rows : 2 * rows]  # [B]
        self.window_starts: list[torch.Tensor] = []  # per group [B]: position of column 0
        self.tables: list[torch.Tensor] = []  # per group [B, W]: pool blocks
        offset = 2 * rows
        for width in bucket.widths:
            self.window_starts.append(inputs[offset : offset + rows])
            offset += rows
            self.tables.append(inputs[offset : offset + rows * width].view(rows, width))
            offset += rows * width
        self.write_slots: list[torch.Tensor] = []
        self.gather: list[torch.Tensor] = []
        self.visible: list[torch.Tensor] = []

    def positions(self) -> torch.Tensor:
        return self.position_ids

    def commit(self) -> None:
        """Nothing inside the step: the runner commits the sequences' caches on the host."""

    def prepare(self) -> None:
        """Slots, gather indices and masks of every group, on the device (capturable: no
        host value is read)."""
        pos = self.position_ids
        for group, table in enumerate(self.tables):
            start = self.window_starts[group]
            window = self.pool.groups[group].window
            index, visible = gather_plan(table, start, pos, self.pool.block_size, window)
            self.write_slots.append(index.gather(1, (pos - start)[:, None])[:, 0])  # [B]
            self.gather.append(index)  # [B, L]
            self.visible.append(attention_mask(visible[:, None, None, :], self.kv_dtype))


class StaticInputs:
    """The packed inputs: a host buffer (pinned on a GPU) the host fills, and the device
    buffer the steps read, both sized for the largest bucket. On the CPU they are one."""

    def __init__(self, pool: BlockPool, largest: Bucket, device: torch.device) -> None:
        self.pool, self.device = pool, torch.device(device)
        cuda = self.device.type == "cuda"
        self.host = torch.zeros(largest.size, dtype=torch.int64, pin_memory=cuda)
        self.on_device = self.host.to(self.device) if cuda else self.host
        self.host_array = self.host.numpy()
        # the host buffer is refilled only once the device has taken its last copy
        self.copied = torch.cuda.Event() if cuda else None
        # a block per group that no sequence owns: padding rows write and read there
        self.scratch = [pool.allocate(group=g) for g in range(len(pool.groups))]

    def fill(
        self,
        bucket: Bucket,
        tokens: Sequence[int],
        chunks: Sequence[SequenceChunk],
        previous: torch.Tensor | None = None,
    ) -> None:
        """Write one decode step's inputs for `bucket` and copy them to the device. With
        `previous` (the token ids a step before sampled, still on the device), `tokens`
        are row numbers into it: the ids are gathered there, after the copy, so the host
        never waits for them (runtime/generator.py's overlapped steps)."""
        rows, n = bucket.rows, len(chunks)
        if self.copied is not None:
            self.copied.synchronize()
        packed = self.host_array[: bucket.size]
        packed[:rows] = 0
        packed[:n] = tokens
        positions = packed[rows : 2 * rows]
        positions[:] = 0
        positions[:n] = [c.start for c in chunks]
        offset = 2 * rows
        for group, width in enumerate(bucket.widths):
            starts = packed[offset : offset + rows]
            offset += rows
            table = packed[offset : offset + rows * width].reshape(rows, width)
            offset += rows * width
            starts[:] = 0
            table[:] = self.scratch[group]
            fill_tables(self.pool, chunks, group, starts, table)
        if self.on_device is not self.host:
            self.on_device[: bucket.size].copy_(self.host[: bucket.size], non_blocking=True)
            self.copied.record()
        if previous is not None:
            ids = self.on_device[:n]
            torch.index_select(previous, 0, ids.clone(), out=ids)

    def layout(self, bucket: Bucket) -> StaticDecodeLayout:
        return StaticDecodeLayout(self.pool, self.on_device, bucket)


def widths_needed(pool: BlockPool, chunks: Sequence[SequenceChunk]) -> list[int]:
    """Per group, the most table blocks any row's window spans this step."""
    bs = pool.block_size
    needed = []
    for group in pool.groups:
        if group.window is None:
            needed.append(max(c.start // bs + 1 for c in chunks))
        else:
            needed.append(
                max(c.start // bs - max(0, c.start + 1 - group.window) // bs + 1 for c in chunks)
            )
    return needed


def decode_widths(pool: BlockPool, chunks: Sequence[SequenceChunk]) -> tuple[int, ...]:
    """The table widths a decode step of `chunks` attends over, per group: the eager step
    (tensor_attention.py) pads to the same widths as the static step's bucket, so that a
    row's keys sit at the same columns of an attention of the same length either way."""
    full, needed = MIN_WIDTH_BLOCKS, widths_needed(pool, chunks)[0]
    while full < needed:
        full *= 2
    return group_widths(pool, full)


def group_widths(pool: BlockPool, full_width: int) -> tuple[int, ...]:
    """A bucket's widths from its full-attention width: a windowed group spans at most its
    window's blocks plus one (the window rarely starts on a block boundary)."""
    bs = pool.block_size
    return tuple(
        full_width if g.window is None else min(full_width, -(-g.window // bs) + 1)
        for g in pool.groups
    )


def fill_tables(
    pool: BlockPool,
    chunks: Sequence[SequenceChunk],
    group: int,
    starts: np.ndarray,
    table: np.ndarray,
) -> None:
    """Each decoding row's table window in `group`: the position of its first column
    (`starts[i]`, block-aligned) and its blocks (`table[i]`, the rest left as they are)."""
    bs, window = pool.block_size, pool.groups[group].window
    for i, chunk in enumerate(chunks):
        first = 0 if window is None else max(0, chunk.start + 1 - window)
        blocks = chunk.cache.tables[group][first // bs : chunk.start // bs + 1]
        starts[i] = first // bs * bs
        table[i, : len(blocks)] = blocks


def gather_plan(
    table: torch.Tensor | np.ndarray,
    starts: torch.Tensor | np.ndarray,
    positions: torch.Tensor | np.ndarray,
    block_size: int,
    window: int | None,
):
    """From table windows `[B, W]`, their starts and the rows' positions `[B]`: the pool
    slot of every column `[B, W * bs]` and which columns each row sees (numpy or torch,
    the same operations)."""
    rows, width = table.shape
    if isinstance(table, torch.Tensor):  # made on the device: a capture copies nothing in
        offsets = torch.arange(block_size, device=table.device)
        k_offsets = torch.arange(width * block_size, device=table.device)
    else:
        offsets, k_offsets = np.arange(block_size), np.arange(width * block_size)
    index = (table[:, :, None] * block_size + offsets).reshape(rows, width * block_size)
    k_pos = starts[:, None] + k_offsets  # [B, L]
    pos = positions[:, None]
    visible = k_pos <= pos
    if window is not None:
        visible &= (pos - k_pos) < window
    return index, visible


def attention_mask(visible: torch.Tensor | np.ndarray, kv_dtype) -> torch.Tensor:
    """What attention takes as its mask: on a GPU an additive bias in the keys' dtype (0 or
    -inf), made once per step rather than by the fused kernel in every layer; on the CPU
    the boolean mask itself."""
    if isinstance(visible, np.ndarray):
        visible = torch.from_numpy(visible)
    if kv_dtype == torch.float32:
        return visible
    bias = torch.zeros(visible.shape, dtype=kv_dtype, device=visible.device)
    return bias.masked_fill_(~visible, -torch.inf)


def as_index(values: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Token ids or positions as an int64 tensor on `device`."""
    if isinstance(values, torch.Tensor):
        return values
    return torch.from_numpy(np.ascontiguousarray(values, np.int64)).to(device)
