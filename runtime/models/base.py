"""Pieces every architecture shares: the packed batch layout, norms, rope and attention.

A forward pass takes the new tokens of several sequences packed into one array `[T]`
(vLLM-style, no padding): the linear layers run once over all of them, and only attention
is done per sequence, against that sequence's own KV cache.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.kv_cache import KVCache


@dataclass
class SequenceChunk:
    """`length` new tokens of one sequence, at positions `start .. start + length - 1`."""

    cache: KVCache
    start: int
    length: int


@dataclass
class BatchLayout:
    """Which rows of the packed token array belong to which sequence, in order."""

    chunks: list[SequenceChunk]

    def __post_init__(self) -> None:
        offsets = np.cumsum([0] + [c.length for c in self.chunks])
        # (first row, end row, chunk) per sequence; layers walk this once each
        self.spans = [(int(offsets[i]), int(offsets[i + 1]), c) for i, c in enumerate(self.chunks)]

    def positions(self) -> np.ndarray:
        return np.concatenate([np.arange(c.start, c.start + c.length) for c in self.chunks])

    def commit(self) -> None:
        """Record in each cache that the forward pass stored its tokens."""
        for chunk in self.chunks:
            chunk.cache.length = chunk.start + chunk.length


def rms_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis without its weight (folded into the next matmul)."""
    if x.ndim == 2 and x.shape[0] == 1:  # single-token decode: a scalar is cheaper
        row = x[0]
        return x * np.float32(1.0 / np.sqrt(float(row @ row) / row.shape[0] + eps))
    mean_sq = np.einsum("...d,...d->...", x, x)[..., None] / x.shape[-1]  # [..., 1]
    return x * (1.0 / np.sqrt(mean_sq + eps)).astype(np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis; `weight` already holds any +1 offset (as GGUF stores it)."""
    return rms_normalize(x, eps) * weight


def rope_inv_freq(n_rot: int, base: float, freq_factors: np.ndarray | None = None) -> np.ndarray:
    inv_freq = 1.0 / (base ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot))  # [n_rot/2]
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    return inv_freq


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0):
    """cos/sin `[T, 1, n_rot/2]` for the given positions (linear scaling divides them)."""
    angles = np.outer(positions.astype(np.float64) / scale, inv_freq)  # [T, n_rot/2]
    return np.cos(angles).astype(np.float32)[:, None], np.sin(angles).astype(np.float32)[:, None]


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """NeoX rotation of `x` `[T, heads, Dh]`: dims i and i + n_rot/2 form a pair."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rotated = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if 2 * half == x.shape[-1]:
        return rotated
    return np.concatenate([rotated, x[..., 2 * half :]], axis=-1)


def attend(
    q: np.ndarray,
    segments: list[tuple[np.ndarray, np.ndarray]],
    start: int,
    window: int | None = None,
) -> np.ndarray:
    """Causal GQA attention of `n` queries at positions `start..` over one sequence's cache.

    q `[n, H, Dh]` (already scaled by 1/sqrt(Dh)); the cache as segments in position order,
    each keys `[Hkv, Dh, l]` (transposed, so q @ K is a plain matmul) and values `[Hkv, l,
    Dh]`, together L = start + n positions -> `[n, H * Dh]`. `window` limits each query to
    the keys less than `window` positions behind it.
    """
    n, n_heads, head_dim = q.shape
    n_kv = segments[0][0].shape[0]
    group = n_heads // n_kv
    if n == 1 and window is None and len(segments) == 1:  # the common decode case, lean
        keys_t, values = segments[0]
        scores = np.matmul(q.reshape(n_kv, group, head_dim), keys_t)  # [Hkv, G, L]
        _softmax_inplace(scores)
        return np.matmul(scores, values).reshape(1, n_heads * head_dim)
    total = sum(k.shape[-1] for k, _ in segments)
    first = 0 if window is None else max(0, start + 1 - window)
    segments = _from_position(segments, first)
    if n == 1:  # decode: no query transposes, no mask beyond the window
        qg = q.reshape(n_kv, group, head_dim)
    else:
        qg = q.reshape(n, n_kv, group, head_dim).transpose(1, 2, 0, 3)  # [Hkv, G, n, Dh]
        qg = qg.reshape(n_kv, group * n, head_dim)
    parts = [np.matmul(qg, keys_t) for keys_t, _ in segments]  # [Hkv, G*n, l] each
    scores = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)
    if n > 1:
        scores = scores.reshape(n_kv, group, n, -1)
        scores += _mask_bias(n, start, first, total, window)  # [n, L'] over heads
        scores = scores.reshape(n_kv, group * n, -1)
    _softmax_inplace(scores)
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
) -> np.ndarray:
    """Store each sequence's new keys/values in its cache and attend over it.

    q `[T, H, Dh]`, k and v `[T, Hkv, Dh]` for the packed tokens -> `[T, H * Dh]`.
    """
    t, n_heads, head_dim = q.shape
    out = np.empty((t, n_heads * head_dim), np.float32)
    for lo, hi, chunk in layout.spans:
        segments = chunk.cache.update_and_fetch(layer, chunk.start, k[lo:hi], v[lo:hi])
        out[lo:hi] = attend(q[lo:hi], segments, chunk.start, window)
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


def _softmax_inplace(scores: np.ndarray) -> None:
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)


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


def gelu_tanh_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gelu_tanh(gate) * up, computed in one scratch buffer."""
    out = gate * gate
    out *= np.float32(0.044715)
    out += 1.0
    out *= gate
    out *= np.float32(0.7978845608028654)  # sqrt(2 / pi) * (x + 0.044715 x^3)
    np.tanh(out, out=out)
    out += 1.0
    out *= gate
    out *= np.float32(0.5)
    out *= up
    return out


def gated_mlp(
    x: np.ndarray, w_gate_up: np.ndarray, w_down_t: np.ndarray, activation_mul
) -> np.ndarray:
    """down(act(gate(x)) * up(x)) with gate and up fused into one `[D, 2F]` matmul."""
    gate_up = x @ w_gate_up  # [T, D] -> [T, 2F]
    ffn_dim = w_gate_up.shape[1] // 2
    return activation_mul(gate_up[:, :ffn_dim], gate_up[:, ffn_dim:]) @ w_down_t.T  # -> [T, D]


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu(gate) * up in one scratch buffer: decode is dominated by per-op overhead."""
    out = np.negative(gate)
    np.exp(out, out=out)
    out += 1.0
    np.divide(gate, out, out=out)
    out *= up
    return out


class DecoderModel:
    """What every architecture shares around its layers: the cache it needs, the LM head
    (`output`, which is `embed` when tied), and its size. Subclasses set `args` (with
    n_layers, n_kv_heads, head_dim, context_length), `embed`, `output`, `norm`, `layers`."""

    args: Any
    embed: np.ndarray  # [V, D]
    output: np.ndarray  # [V, D]
    norm: np.ndarray
    layers: list[Any]

    @property
    def context_length(self) -> int:
        return self.args.context_length

    @property
    def vocab_size(self) -> int:
        return self.output.shape[0]

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim): what a KV cache of this model holds per token."""
        return self.args.n_layers, self.args.n_kv_heads, self.args.head_dim

    def new_cache(self, max_tokens: int) -> KVCache:
        return KVCache(*self.kv_shape, max_tokens)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        return hidden @ self.output.T  # [N, D] -> [N, V]

    @property
    def nbytes(self) -> int:
        """Bytes of float32 weights (a tied head counted once)."""
        arrays = {id(a): a for a in (self.embed, self.output, self.norm)}
        for layer in self.layers:
            for weight in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down_t):
                arrays[id(weight)] = weight
        return sum(a.nbytes for a in arrays.values())


def pack_linear(parts: list[np.ndarray], input_scale: np.ndarray | None = None) -> np.ndarray:
    """Fuse weights given as `[out_i, in]` into one `[in, sum(out_i)]` matrix for `x @ W`.

    `input_scale` `[in]` folds a preceding elementwise scale (an RMSNorm weight) into the
    rows, saving a pass over the activations at every step. Filled part by part so that
    loading never holds a second full copy of the fused matrix.
    """
    n_in = parts[0].shape[1]
    fused = np.empty((n_in, sum(p.shape[0] for p in parts)), np.float32)
    offset = 0
    for part in parts:
        fused[:, offset : offset + part.shape[0]] = part.T
        offset += part.shape[0]
    if input_scale is not None:
        fused *= input_scale[:, None]
    return fused
