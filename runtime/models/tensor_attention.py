"""Attention for the tensor forward pass: the paged KV pool on the device, gathered.

The pool keeps each layer's keys and values slot-major, `[slots, Hkv, Dh]`. A step's new
keys and values go in with one `index_copy_` per layer. Decode rows gather their table
windows (the static step's, static_decode.py) into a padded `[M, L]` batch and attend in
one call (`decode_attention`) with a mask for the padding and the window. On a GPU a
prefill chunk attends alone with a causal mask; on the CPU its rows attend as decode rows,
so that CI sees a row's numbers alike prefilled or decoded, cached or not. Every index and
mask is built on the host once per forward pass and uploaded once; the layers then only
launch device work, so no layer waits on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from runtime.models.attention import _plan, _shared_pool, _slot_ids
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.models.static_decode import (
    StaticDecodeLayout,
    attention_mask,
    decode_widths,
    fill_tables,
    gather_plan,
)

# keys a CPU's attention takes at a time: static_decode.MIN_WIDTH_BLOCKS x 16 positions,
# so every full-attention width (a power of two of at least that) is whole chunks; a
# windowed group's (its window's blocks plus one) is padded up to them
KEY_CHUNK = 256
# decode rows gathered at once: on the CPU a prompt's rows in a windowed group attend as
# decode rows, [rows, Hkv, width, Dh] each for keys and values (Gemma 3's window of 512:
# 528 positions, 138 MiB for 128 rows), so a long prompt's are gathered in slices
DECODE_ROWS_AT_ONCE = 128


@dataclass
class GatheredRows:
    """Queries `rows` of the packed tokens over the pool slots `index` `[M, L]` (decode) or
    `[L]` (one prefill chunk), where `mask` is True."""

    rows: torch.Tensor | slice
    index: torch.Tensor
    mask: torch.Tensor


@dataclass
class TensorAttentionPlan:
    slots: torch.Tensor  # [T]: where each packed token's key and value are written
    decode: list[GatheredRows]
    prefill: list[GatheredRows]


def attend_layout(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: BatchLayout,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q `[T, H, Dh]` (already scaled by 1/sqrt(Dh)), k and v `[T, Hkv, Dh]` -> `[T, H*Dh]`;
    `softcap` caps the scores (Gemma 2: `capped`); `sinks` `[H]` float32 join each head's
    softmax denominator and weigh no value (gpt-oss)."""
    t, n_heads, head_dim = q.shape
    pool = _shared_pool(layout)
    group, keys, values = pool.layer_storage(layer, window)  # keys, values [slots, Hkv, Dh]
    plan = _plan(
        layout, ("tensor", group, window), lambda lay: _build(lay, group, window, q.device)
    )
    keys.index_copy_(0, plan.slots, k.to(keys.dtype))
    values.index_copy_(0, plan.slots, v.to(values.dtype))
    out = torch.empty((t, n_heads * head_dim), dtype=torch.float32, device=q.device)
    for rows in plan.decode:
        o = _attend_gathered(q[rows.rows], keys, values, rows.index, rows.mask, softcap, sinks)
        out[rows.rows] = o.reshape(len(rows.index), n_heads * head_dim).float()
    for rows in plan.prefill:
        if q.device.type != "cuda":
            qp, index = q[rows.rows], rows.index
            o = prompt_attention(qp, keys[index], values[index], rows.mask, softcap, sinks)
            out[rows.rows] = o.reshape(-1, n_heads * head_dim)
            continue
        qp = q[rows.rows].transpose(0, 1).unsqueeze(0).to(keys.dtype)  # [1, H, n, Dh]
        kp = keys[rows.index].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, Dh]
        vp = values[rows.index].transpose(0, 1).unsqueeze(0)
        o = _gpu_attention(qp, kp, vp, rows.mask, softcap, sinks)  # [1, H, n, Dh]
        out[rows.rows] = o[0].transpose(0, 1).reshape(-1, n_heads * head_dim).float()
    return out


def _attend_gathered(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    index: torch.Tensor,
    visible: torch.Tensor,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Decode rows (one query each, q `[M, H, Dh]`) over the keys and values their slot
    indices `index` `[M, L]` gather from a layer's storage -> `[M, H, 1, Dh]`, in the
    storage's dtype: `attend_layout`'s decode rows and `attend_static`'s."""
    qd = q.unsqueeze(2).to(keys.dtype)  # [M, H, 1, Dh]
    kd = keys[index].transpose(1, 2)  # [M, L, Hkv, Dh] -> [M, Hkv, L, Dh]
    vd = values[index].transpose(1, 2)
    return decode_attention(qd, kd, vd, visible, softcap, sinks)


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """cap * tanh(scores / cap) (as llama.cpp: times 1/cap, tanh, times cap)."""
    if softcap is None:
        return scores
    return torch.tanh(scores * (1.0 / softcap)) * softcap


def _gpu_attention(q, keys, values, visible, softcap: float | None, sinks=None) -> torch.Tensor:
    """q `[B, H, n, Dh]` over keys and values `[B, Hkv, L, Dh]` where `visible` (booleans,
    or a bias) on a GPU: the fused kernel, or, with a cap on the scores or sinks it cannot
    apply, the scores, cap, mask and softmax written out (float32), each KV head's keys
    multiplied by its G query heads at once (not copied G times: gpt-oss-120b's 64 heads
    over 8 KV heads at 8k keys would copy 0.25 GiB a row and layer)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=visible, scale=1.0, enable_gqa=True
        )
    b, heads, n, head_dim = q.shape
    n_kv = keys.shape[1]
    grouped = q.float().reshape(b, n_kv, heads // n_kv * n, head_dim)  # [B, Hkv, G*n, Dh]
    scores = capped(grouped @ keys.float().transpose(-1, -2), softcap)  # [B, Hkv, G*n, L]
    scores = scores.view(b, heads, n, -1)
    if visible.dtype == torch.bool:
        scores = scores.masked_fill(~visible, -torch.inf)
    else:
        scores = scores + visible
    if sinks is None:
        weights = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.view(1, -1, 1, 1).expand(b, heads, n, 1)  # one more logit per row
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    out = weights.reshape(b, n_kv, -1, weights.shape[-1]) @ values.float()  # [B, Hkv, G*n, Dh]
    return out.view(b, heads, n, head_dim).to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per row over its gathered keys: q `[B, H, 1, Dh]`, keys and values
    `[B, Hkv, L, Dh]`, visible `[B, 1, 1, L]` (static_decode.attention_mask: a bias on a GPU,
    booleans on the CPU), sinks `[H]` or None -> `[B, H, 1, Dh]`. Each row's result must not
    depend on how many rows there are, nor on how many masked keys pad its row (the width
    its batch takes): on a GPU the fused kernel works per row and head, over blocks of keys
    in order. On the CPU, torch's fused kernel splits its work by the batch's size, and a
    softmax and product over all L keys sum them by L's blocking (a row at position ~300
    came out differently at widths 512 and 1024); so the CPU takes the keys KEY_CHUNK at a
    time: per chunk the scores, exp against the row's max, their sum and their product with
    the values, then the chunks added in order, where chunks of masked keys add exact zeros
    (the G query heads that share a KV head as that head's G queries). Each chunk's two
    products are one item of a batched BLAS call of the same shape and layout for every row
    (`_per_item`)."""
    if q.device.type == "cuda":
        # heads as heads (enable_gqa), not a KV head's G queries: on an H200 the grouped
        # form measured 2.51 ms a SmolLM2 step at one row against 2.09
        # (bench/log/2026-11-27-gpu-h200-decode-graphs.md)
        return _gpu_attention(q, keys, values, visible, softcap, sinks)
    rows, n_heads, _, head_dim = q.shape
    n_kv, length = keys.shape[1], keys.shape[2]
    chunks = -(-length // KEY_CHUNK)
    if chunks * KEY_CHUNK != length:  # a windowed group's width: padded with masked keys
        extra = chunks * KEY_CHUNK - length
        keys, values = F.pad(keys, (0, 0, 0, extra)), F.pad(values, (0, 0, 0, extra))
        visible = F.pad(visible, (0, extra), value=False)
    g = n_heads // n_kv
    grouped = q.reshape(rows, n_kv, 1, g, head_dim).expand(rows, n_kv, chunks, g, head_dim)
    keys = keys.reshape(rows, n_kv, chunks, KEY_CHUNK, head_dim)  # [B, Hkv, C, K, Dh]
    values = values.reshape(rows, n_kv, chunks, KEY_CHUNK, head_dim)
    seen = visible.reshape(rows, 1, chunks, 1, KEY_CHUNK)
    scores = capped(_per_item(grouped, keys, transposed=True), softcap)  # [B, Hkv, C, G, K]
    scores = scores.masked_fill(~seen, -torch.inf)
    sink = None if sinks is None else sinks.view(1, n_kv, 1, g, 1)
    out = _over_chunks(scores, values, 2, lambda w, v: _per_item(w, v, False), sink)
    return out.reshape(rows, n_heads, 1, head_dim)


# Why every attention product on the CPU is a batch of items of one shape and layout:
# torch's CPU matmul hands BLAS (MKL) whatever its operands' strides allow, and MKL's
# rounding of a row depends on the product's row count and on whether an operand is read
# transposed. On an AMD EPYC Zen 4 (MKL 2024.2 in torch 2.13) a row of [M, 16] @ [16, 256]
# came out differently with M = 4 or more than with M = 2, and with the [16, 256] operand
# read transposed or not; a row decoded alone gave keys torch's matmul reads transposed
# in place, two rows or more a contiguous copy, so a request's logits moved by up to
# 7e-7 beside batch mates (tests/runtime/test_lora_graphs.py, test_tensor_same_answer.py
# resumed). With G query rows per item, keys read transposed from [K, Dh] and values
# read as [K, Dh], every item is the same product however many rows share the call, and
# a prompt's row (`_shared_keys`) is the product a decode row computes at its position.


def _per_item(a: torch.Tensor, b: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`a [..., G, X]` times each item of `b` (`[..., Y, X]` transposed, or `[..., X, Y]`),
    the same leading dims: one batched product whose items are all `[G, X]` by a
    contiguous `b` item -> `[..., G, Y]`."""
    lead = a.shape[:-2]
    a = a.contiguous().view(-1, *a.shape[-2:])
    b = b.contiguous().view(-1, *b.shape[-2:])
    out = torch.bmm(a, b.transpose(1, 2) if transposed else b)
    return out.view(*lead, *out.shape[-2:])


def _shared_keys(a: torch.Tensor, b: torch.Tensor, transposed: bool) -> torch.Tensor:
    """`_per_item` where a chunk's keys or values serve all n rows of a prompt: `a` is
    `[Hkv, C, n, G, X]`, `b` `[Hkv, C, Y, X]` (transposed) or `[Hkv, C, X, Y]`; per KV head
    and chunk, one batched product of n items that all read the same `b` item (a batch
    stride of 0, not n copies) -> `[Hkv, C, n, G, Y]`."""
    n_kv, chunks, n, g, _ = a.shape
    a, b = a.contiguous(), b.contiguous()
    width = b.shape[-2] if transposed else b.shape[-1]
    out = torch.empty((n_kv, chunks, n, g, width), dtype=a.dtype, device=a.device)
    for h in range(n_kv):
        for c in range(chunks):
            item = b[h, c].t() if transposed else b[h, c]
            torch.bmm(a[h, c], item.expand(n, *item.shape), out=out[h, c])
    return out


def _over_chunks(
    scores: torch.Tensor,
    values: torch.Tensor,
    dim: int,
    product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention from masked scores `[..., M, K]` whose dim `dim` is the key chunks, and
    their values: exp against each query's max over all chunks, per chunk the sum and the
    product with the values (`product(weights, values)`, chunks at `dim` too), then the
    chunks added in order, where chunks of masked keys add exact zeros -> the product's
    shape without `dim`. `sink` (shaped as the max, a size-1 `dim`): one more logit per
    query in the max and, after the chunks, in the sum."""
    top = scores.amax(dim=-1, keepdim=True).amax(dim=dim, keepdim=True)
    if sink is not None:
        top = torch.maximum(top, sink)
    weights = torch.exp(scores - top)  # a masked key's is 0
    sums = weights.sum(dim=-1, keepdim=True)  # chunks at `dim`, [..., M, 1]
    parts = product(weights, values)  # chunks at `dim`, [..., M, Dh]
    total, norm = parts.select(dim, 0), sums.select(dim, 0)
    for c in range(1, scores.shape[dim]):
        total, norm = total + parts.select(dim, c), norm + sums.select(dim, c)
    if sink is not None:
        norm = norm + torch.exp(sink - top).select(dim, 0)
    return total / norm


def prompt_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A prompt's rows over its sequence's keys on the CPU, each row as `decode_attention`
    computes a decode row at its position (the same chunks of KEY_CHUNK keys from position
    0, the same products per chunk, the chunks added in order), with the keys gathered once
    for all rows: q `[n, H, Dh]`, keys and values `[L, Hkv, Dh]` (L a decode width),
    visible `[n, L]` -> `[n, H, Dh]`. So a position's numbers are the same prefilled or
    decoded: a resumed request prefills what it decoded before, and a cache hit leaves
    another part of the prompt to prefill."""
    n, n_heads, head_dim = q.shape
    length, n_kv = keys.shape[0], keys.shape[1]
    g, chunks = n_heads // n_kv, length // KEY_CHUNK
    grouped = q.reshape(n, n_kv, 1, g, head_dim).permute(1, 2, 0, 3, 4)  # [Hkv, 1, n, G, Dh]
    grouped = grouped.expand(n_kv, chunks, n, g, head_dim)
    keys = keys.permute(1, 0, 2).reshape(n_kv, chunks, KEY_CHUNK, head_dim)  # [Hkv, C, K, Dh]
    values = values.permute(1, 0, 2).reshape(n_kv, chunks, KEY_CHUNK, head_dim)
    seen = visible.reshape(n, chunks, KEY_CHUNK).transpose(0, 1)  # [C, n, K]
    seen = seen.reshape(1, chunks, n, 1, KEY_CHUNK)
    scores = capped(_shared_keys(grouped, keys, transposed=True), softcap)  # [Hkv, C, n, G, K]
    scores = scores.masked_fill(~seen, -torch.inf)
    sink = None if sinks is None else sinks.view(n_kv, 1, 1, g, 1)
    out = _over_chunks(scores, values, 1, lambda w, v: _shared_keys(w, v, False), sink)
    return out.permute(1, 0, 2, 3).reshape(n, n_heads, head_dim)  # [Hkv, n, G, Dh] ->


def attend_static(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: StaticDecodeLayout,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A static decode step's attention (static_decode.py): one query per row over the
    keys of its table window; q `[B, H, Dh]` (scaled), k and v `[B, Hkv, Dh]` -> `[B, H*Dh]`."""
    rows, n_heads, head_dim = q.shape
    pool = layout.pool
    group, keys, values = pool.layer_storage(layer, window)  # keys, values [slots, Hkv, Dh]
    keys.index_copy_(0, layout.write_slots[group], k.to(keys.dtype))
    values.index_copy_(0, layout.write_slots[group], v.to(values.dtype))
    index, visible = layout.gather[group], layout.visible[group]  # [B, L]
    o = _attend_gathered(q, keys, values, index, visible, softcap, sinks)  # [B, H, 1, Dh]
    # left in the keys' dtype: the output product rounds it to its own (fp16 -> bf16 is
    # the same rounding as through float32), and a static step has no LoRA rows
    return o.reshape(rows, n_heads * head_dim)


def prepare(layout: BatchLayout, windows: list[int | None], device: torch.device) -> None:
    """Build and upload every layer group's plan before the forward pass enqueues device
    work: an upload from pageable memory waits for the stream, so a plan built at its first
    layer would make the host wait for the layers before it."""
    pool = _shared_pool(layout)
    for layer, window in enumerate(windows):
        group = pool.group_of[layer]
        _plan(
            layout,
            ("tensor", group, window),
            lambda lay, g=group, w=window: _build(lay, g, w, device),
        )


def _build(
    layout: BatchLayout, group: int, window: int | None, device: torch.device
) -> TensorAttentionPlan:
    """Slots, gather indices and masks of one layer group for this forward pass."""
    slots, pool = _slot_ids(layout, group), _shared_pool(layout)
    decode_rows, prefill = [], []
    # on the CPU a prompt's rows attend as decode rows do (`prompt_attention`; a windowed
    # group's rows each gather their own window, as a decode row does), so that a row's
    # numbers are the same whether its position was prefilled or decoded
    on_cpu = device.type != "cuda"
    for lo, hi, chunk in layout.spans:
        first = 0 if window is None else max(0, chunk.start + 1 - window)  # the first query's
        end = chunk.start + hi - lo
        if hi - lo == 1 or (on_cpu and window is not None):  # a window's rows: few keys each
            decode_rows += [
                (lo + i, SequenceChunk(chunk.cache, chunk.start + i, 1)) for i in range(hi - lo)
            ]
            continue
        index = chunk.cache.slot_ids(first, end, group)
        length = end - first
        if on_cpu:  # the decode step's window: from 0, its width, padding masked
            length = decode_widths(pool, [SequenceChunk(chunk.cache, end - 1, 1)])[group]
            length *= pool.block_size
            index = np.concatenate([index, np.full(length - len(index), index[-1])])
        q_pos = np.arange(chunk.start, end)[:, None]  # [n, 1]
        k_pos = np.arange(first, first + length)[None, :]  # [1, L]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= (q_pos - k_pos) < window
        prefill.append(
            GatheredRows(slice(lo, hi), _upload(index, device), _upload(visible, device))
        )
    decode = [
        _decode_rows(decode_rows[i : i + DECODE_ROWS_AT_ONCE], pool, group, window, device)
        for i in range(0, len(decode_rows), DECODE_ROWS_AT_ONCE)
    ]
    return TensorAttentionPlan(_upload(slots, device), decode, prefill)


def _decode_rows(
    decode_rows: list[tuple[int, SequenceChunk]],
    pool,
    group: int,
    window: int | None,
    device: torch.device,
) -> GatheredRows:
    """Rows that attend one query each, over their table windows gathered side by side."""
    # the static step's table windows (static_decode.py), padded to its widths, so
    # that a row's attention is the same whether it decodes eagerly or from a graph
    chunks = [chunk for _, chunk in decode_rows]
    width = decode_widths(pool, chunks)[group]
    starts = np.zeros(len(chunks), np.int64)
    # padding columns (masked) read the row's own last block
    last = [c.cache.tables[group][c.start // pool.block_size] for c in chunks]
    table = np.repeat(np.array(last, np.int64)[:, None], width, axis=1)  # [M, W]
    fill_tables(pool, chunks, group, starts, table)
    positions = np.array([c.start for c in chunks])
    index, visible = gather_plan(table, starts, positions, pool.block_size, window)
    rows = np.array([lo for lo, _ in decode_rows])
    mask = attention_mask(_upload(visible[:, None, None, :], device), pool.keys[0].dtype)
    return GatheredRows(_upload(rows, device), _upload(index, device), mask)


def _upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if tensor.dtype != torch.bool:
        tensor = tensor.to(torch.int64)
    return tensor.to(device, non_blocking=True)
