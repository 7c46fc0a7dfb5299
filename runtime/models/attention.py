"""Attention over the KV cache for a packed batch of sequences.

Every cache is a `PagedKVCache`, and the sequences of one forward pass share one block
pool (the generator's; a single-sequence helper's cache has a small pool of its own). A
step's keys/values are stored with one scatter per layer. Then, where the C kernel builds
(runtime/kernels/native.py), every packed row - a decode token or a prefill token alike -
attends over its own keys in position order, read through their pool slots: one call per
layer for the whole batch, and a row's numbers are the same whatever shares its forward
pass, however its blocks lie in the pool, cached or not (docs/contract.md, "same request, same
answer"; bench/invariance.py measures it).

Without a C compiler the numpy path below runs: decode rows attend in length-sorted groups
(per sequence two small matmuls write into a shared padded score buffer, and one softmax
covers the group; members holding the same cached prefix meet its keys in one matmul), and
prefill chunks one sequence at a time over their runs of blocks. BLAS rounds those sums
differently with the batch, by ~1e-6.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from runtime.kernels.native import RowKeys, paged_attention
from runtime.kv_pool import BlockPool
from runtime.models.base import BatchLayout

# a decode group's padded score rows are at most this many times its shortest sequence, so
# sequences of very different lengths do not spend the step on padding
MAX_PADDING_FACTOR = 2

T = TypeVar("T")


def attend(
    q: np.ndarray,
    segments: list[tuple[np.ndarray, np.ndarray]],
    start: int,
    window: int | None = None,
    offset: int = 0,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Causal GQA attention of `n` queries at positions `start..` over one sequence's cache.

    q `[n, H, Dh]` (already scaled by 1/sqrt(Dh)); the cache as segments in position order,
    each keys `[Hkv, Dh, l]` (transposed views of the pool's slot-major keys) and values
    `[Hkv, l, Dh]`, together positions `offset ..
    start + n - 1` -> `[n, H * Dh]`. `window` limits each query to the keys less than
    `window` positions behind it; `softcap` caps each score (`capped`); `sinks` `[H]` are
    logits that join each head's softmax denominator and weigh no value (gpt-oss).
    """
    n, n_heads, head_dim = q.shape
    n_kv = segments[0][0].shape[0]
    group = n_heads // n_kv
    # [Hkv, G*n, 1]: a row's sink beside its scores (rows of one head are adjacent)
    sink = None if sinks is None else np.repeat(sinks.reshape(n_kv, group, 1), n, axis=1)
    if n == 1 and window is None and len(segments) == 1 and offset == 0:  # lean decode
        keys_t, values = segments[0]
        scores = capped(np.matmul(q.reshape(n_kv, group, head_dim), keys_t), softcap)
        _softmax_inplace(scores, sink)  # [Hkv, G, L]
        return np.matmul(scores, values).reshape(1, n_heads * head_dim)
    total = offset + sum(k.shape[-1] for k, _ in segments)
    first = offset if window is None else max(offset, start + 1 - window)
    segments = _from_position(segments, first - offset)
    if n == 1:  # decode: no query transposes, no mask beyond the window
        qg = q.reshape(n_kv, group, head_dim)
    else:
        qg = q.reshape(n, n_kv, group, head_dim).transpose(1, 2, 0, 3)  # [Hkv, G, n, Dh]
        qg = qg.reshape(n_kv, group * n, head_dim)
    parts = [np.matmul(qg, keys_t) for keys_t, _ in segments]  # [Hkv, G*n, l] each
    scores = capped(parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1), softcap)
    if n > 1:
        scores = scores.reshape(n_kv, group, n, -1)
        scores += _mask_bias(n, start, first, total, window)  # [n, L'] over heads
        scores = scores.reshape(n_kv, group * n, -1)
    _softmax_inplace(scores, sink)
    out, offset = None, 0
    for _, values in segments:
        part = np.matmul(scores[..., offset : offset + values.shape[1]], values)  # [Hkv, G*n, Dh]
        out = part if out is None else out + part
        offset += values.shape[1]
    if n == 1:
        return out.reshape(1, n_heads * head_dim)
    out = out.reshape(n_kv, group, n, head_dim).transpose(2, 0, 1, 3)  # [n, Hkv, G, Dh]
    return out.reshape(n, n_heads * head_dim)


def attend_layout(
    layer: int,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    layout: BatchLayout,
    window: int | None = None,
    softcap: float | None = None,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Store each sequence's new keys/values in its cache and attend over it.

    q `[T, H, Dh]`, k and v `[T, Hkv, Dh]` for the packed tokens -> `[T, H * Dh]`;
    `softcap` caps the scores (Gemma 2); `sinks` `[H]` join each head's softmax (gpt-oss).
    """
    t, n_heads, head_dim = q.shape
    pool = _shared_pool(layout)
    group = pool.group_of[layer]
    if pool.groups[group].window not in (None, window):
        raise ValueError(f"layer {layer} attends over {window} positions, its KV pool keeps less")
    keys, values = pool.keys[layer], pool.values[layer]
    slots = _plan(layout, ("slots", group), lambda lay: _slot_ids(lay, group))
    keys[:, slots] = k.transpose(1, 0, 2)  # [T, Hkv, Dh] -> [Hkv, T, Dh]
    values[:, slots] = v.transpose(1, 0, 2)
    kernel = paged_attention(keys.dtype)
    if kernel is not None:  # every row alike, whatever shares its forward pass
        rows = _plan(layout, ("rows", group, window), lambda lay: _row_keys(lay, group, window))
        return kernel(q, keys, values, rows, softcap, sinks)
    out = np.empty((t, n_heads * head_dim), np.float32)
    if softcap is not None or sinks is not None:  # every chunk, decode rows too: `attend`
        return _attend_chunks(q, keys, values, layout, group, window, softcap, out, sinks=sinks)
    n_kv = keys.shape[0]  # the layer's own (Gemma 4's layers differ)
    plan = _plan(
        layout,
        ("decode", group, window, n_kv),
        lambda lay: _decode_groups(lay, group, window, n_heads, n_kv),
    )
    for rows in plan:
        rows.attend(q, keys, values, out)
    return _attend_chunks(q, keys, values, layout, group, window, None, out, min_rows=2)


def _attend_chunks(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    layout: BatchLayout,
    group: int,
    window: int | None,
    softcap: float | None,
    out: np.ndarray,
    min_rows: int = 1,
    sinks: np.ndarray | None = None,
) -> np.ndarray:
    """Each sequence's chunk of at least `min_rows` rows over its runs of blocks."""
    for lo, hi, chunk in layout.spans:
        if hi - lo >= min_rows:  # (with 2: prefill chunks; decode rows were done in groups)
            first = 0 if window is None else max(0, chunk.start + 1 - window)
            runs = chunk.cache.runs(first, chunk.start + hi - lo, group)
            segments = [
                (keys[:, a : a + n].transpose(0, 2, 1), values[:, a : a + n]) for a, n in runs
            ]
            out[lo:hi] = attend(q[lo:hi], segments, chunk.start, window, first, softcap, sinks)
    return out


def capped(scores: np.ndarray, softcap: float | None) -> np.ndarray:
    """cap * tanh(scores / cap) in place (as llama.cpp: times 1/cap, tanh, times cap)."""
    if softcap is None:
        return scores
    scores *= np.float32(1.0 / softcap)
    np.tanh(scores, out=scores)
    scores *= np.float32(softcap)
    return scores


@dataclass
class SharedRun:
    """Pool slots `slot .. slot + n` that several members of a decode group see first (a
    cached prefix they all hold): their queries meet those keys in one matmul."""

    slot: int
    n: int
    members: np.ndarray  # indices into the group's members


@dataclass
class DecodeGroup:
    """Decode rows of similar cache length attended together.

    `rows` are the packed-token rows; `runs[m]` lists, for member m, `(slot, n, offset)`:
    n consecutive pool slots from `slot` land at `offset` in its score row. `shared` runs
    (at offset 0) are done for all their members at once and are not in `runs`. `scores`
    keeps -inf wherever a member has no key (the padding), so only the runs are rewritten
    per layer; `probs` is the softmax's scratch.
    """

    rows: np.ndarray
    runs: list[list[tuple[int, int, int]]]
    shared: list[SharedRun]
    scores: np.ndarray  # [members, Hkv, G, L_max]
    probs: np.ndarray

    @classmethod
    def build(
        cls, rows: list[int], runs: list[list[tuple[int, int, int]]], shape: tuple[int, int, int]
    ) -> DecodeGroup:
        n_kv, group, width = shape
        scores = np.full((len(rows), n_kv, group, width), -np.inf, np.float32)
        own, shared = _split_shared(runs)
        return cls(np.asarray(rows), own, shared, scores, np.empty_like(scores))

    def attend(self, q: np.ndarray, keys: np.ndarray, values: np.ndarray, out: np.ndarray) -> None:
        members, n_kv, group, _ = self.scores.shape
        head_dim = q.shape[-1]
        qg = q[self.rows].reshape(members, n_kv, group, head_dim)
        scores, probs = self.scores, self.probs
        for run in self.shared:  # [Hkv, S*G, Dh] @ [Hkv, Dh, n]: one matmul for S members
            qs = qg[run.members].transpose(1, 0, 2, 3).reshape(n_kv, -1, head_dim)
            part = np.matmul(qs, keys[:, run.slot : run.slot + run.n].transpose(0, 2, 1))
            scores[run.members, :, :, : run.n] = part.reshape(
                n_kv, len(run.members), group, run.n
            ).transpose(1, 0, 2, 3)
        for m, runs in enumerate(self.runs):
            for slot, n, offset in runs:
                keys_t = keys[:, slot : slot + n].transpose(0, 2, 1)  # [Hkv, Dh, n] view
                np.matmul(qg[m], keys_t, out=scores[m, :, :, offset : offset + n])
        np.subtract(scores, scores.max(axis=-1, keepdims=True), out=probs)
        np.exp(probs, out=probs)
        probs /= probs.sum(axis=-1, keepdims=True)
        result = np.empty((members, n_kv, group, head_dim), np.float32)
        if self.shared:
            result[:] = 0.0
            for run in self.shared:
                ps = probs[run.members, :, :, : run.n].transpose(1, 0, 2, 3)
                part = np.matmul(
                    ps.reshape(n_kv, -1, run.n), values[:, run.slot : run.slot + run.n]
                )
                result[run.members] += part.reshape(
                    n_kv, len(run.members), group, head_dim
                ).transpose(1, 0, 2, 3)
        for m, runs in enumerate(self.runs):
            for i, (slot, n, offset) in enumerate(runs):
                part_probs, part_values = (
                    probs[m, :, :, offset : offset + n],
                    values[:, slot : slot + n],
                )
                if i == 0 and not self.shared:
                    np.matmul(part_probs, part_values, out=result[m])
                else:
                    result[m] += part_probs @ part_values
        out[self.rows] = result.reshape(members, -1)


def _split_shared(
    runs: list[list[tuple[int, int, int]]],
) -> tuple[list[list[tuple[int, int, int]]], list[SharedRun]]:
    """Take out the leading slots that several members share (they start at the same pool
    slot, so the first min(n) slots are the same blocks: a prefix they all hold)."""
    by_first_slot: dict[int, list[int]] = {}
    for m, member_runs in enumerate(runs):
        if member_runs and member_runs[0][2] == 0:
            by_first_slot.setdefault(member_runs[0][0], []).append(m)
    own = [list(member_runs) for member_runs in runs]
    shared = []
    for slot, members in by_first_slot.items():
        if len(members) < 2:
            continue
        n = min(runs[m][0][1] for m in members)
        shared.append(SharedRun(slot, n, np.asarray(members)))
        for m in members:
            _, length, _ = own[m][0]
            own[m] = ([(slot + n, length - n, n)] if length > n else []) + own[m][1:]
    return own, shared


def _shared_pool(layout: BatchLayout) -> BlockPool:
    """The pool every chunk's cache lives in."""
    return _plan(layout, "pool", _find_pool)


def _find_pool(layout: BatchLayout) -> BlockPool:
    pool = layout.chunks[0].cache.pool
    if any(chunk.cache.pool is not pool for chunk in layout.chunks):
        raise ValueError("the sequences of one forward pass must share one KV block pool")
    return pool


def _plan(layout: BatchLayout, key: Hashable, build: Callable[[BatchLayout], T]) -> T:
    """What every layer of one forward pass derives from the layout, computed once."""
    if key not in layout.plans:
        layout.plans[key] = build(layout)
    return layout.plans[key]


def _slot_ids(layout: BatchLayout, group: int) -> np.ndarray:
    """Pool slot of every packed token in a layer group's blocks, in row order."""
    return np.concatenate(
        [c.cache.slot_ids(c.start, c.start + c.length, group) for c in layout.chunks]
    )


def _row_keys(layout: BatchLayout, group: int, window: int | None) -> RowKeys:
    """For the compiled kernel: the pool slots of every sequence's visible keys in position
    order, and per packed row where its own keys start in them and how many it sees (the
    row at position p sees positions max(0, p + 1 - window) .. p)."""
    slots, offsets, counts, base = [], [], [], 0
    for lo, hi, chunk in layout.spans:
        positions = np.arange(chunk.start, chunk.start + hi - lo)
        first = positions - (window - 1) if window is not None else positions * 0
        first = np.maximum(first, 0)
        seq_first = int(first[0])
        seq_slots = chunk.cache.slot_ids(seq_first, int(positions[-1]) + 1, group)
        slots.append(seq_slots)
        offsets.append(base + first - seq_first)
        counts.append(positions + 1 - first)
        base += len(seq_slots)
    return RowKeys.checked(np.concatenate(slots), np.concatenate(offsets), np.concatenate(counts))


def _decode_groups(
    layout: BatchLayout, group: int, window: int | None, n_heads: int, n_kv: int
) -> list[DecodeGroup]:
    """A layer group's decode rows sorted by how many keys they see, cut into groups whose
    longest member is at most MAX_PADDING_FACTOR times the shortest."""
    rows = []
    for lo, hi, chunk in layout.spans:
        if hi - lo == 1:
            end = chunk.start + 1
            first = 0 if window is None else max(0, end - window)
            rows.append((end - first, lo, chunk.cache.runs(first, end, group)))
    groups = []
    for members in group_by_length([row[0] for row in rows]):
        width = rows[members[0]][0]
        runs = [_with_offsets(rows[m][2]) for m in members]
        shape = (n_kv, n_heads // n_kv, width)
        groups.append(DecodeGroup.build([rows[m][1] for m in members], runs, shape))
    return groups


def group_by_length(lengths: list[int], factor: int = MAX_PADDING_FACTOR) -> list[list[int]]:
    """Indices of `lengths`, longest first, cut into groups whose longest is at most
    `factor` times the shortest: padded to its longest, a group computes at most `factor`x
    the scores it needs."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] * factor >= lengths[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _with_offsets(runs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(slot, n) runs -> (slot, n, offset of the run within the sequence's keys)."""
    out, offset = [], 0
    for slot, n in runs:
        out.append((slot, n, offset))
        offset += n
    return out


def _from_position(
    segments: list[tuple[np.ndarray, np.ndarray]], first: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The segments with every position before `first` cut off (sliding windows)."""
    if first == 0:
        return segments
    kept, offset = [], 0
    for keys_t, values in segments:
        length = keys_t.shape[-1]
        if offset + length > first:
            cut = max(0, first - offset)
            kept.append((keys_t[:, :, cut:], values[:, cut:]))
        offset += length
    return kept


def _softmax_inplace(scores: np.ndarray, sink: np.ndarray | None = None) -> None:
    """Softmax over the last axis; `sink` (broadcast to `scores[..., :1]`) is one more
    logit in each denominator, whose weight is dropped (ggml's soft_max with sinks)."""
    if sink is None:
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        return
    peak = np.maximum(scores.max(axis=-1, keepdims=True), sink)
    scores -= peak
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True) + np.exp(sink - peak)


@functools.lru_cache(maxsize=16)  # every layer of one forward pass asks for the same mask
def _mask_bias(n: int, start: int, first: int, total: int, window: int | None) -> np.ndarray:
    """-inf where query i (position start+i) must not see key j (position first+j), else 0."""
    q_pos = np.arange(start, start + n)[:, None]  # [n, 1]
    k_pos = np.arange(first, total)[None, :]  # [1, L']
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= (q_pos - k_pos) >= window
    bias = np.where(hidden, np.float32(-np.inf), np.float32(0.0))
    bias.flags.writeable = False
    return bias
