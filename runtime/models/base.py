"""Pieces every architecture shares: the packed batch layout, norms, rope and attention.

A forward pass takes the new tokens of several sequences packed into one array `[T]`
(vLLM-style, no padding): the linear layers run once over all of them, and attention
(runtime/models/attention.py) reads each sequence's own KV cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.kernels import Embedding, Weight
from runtime.kernels.heads import Exact, head_logits
from runtime.kv_pool import BLOCK_SIZE, BlockPool, PagedKVCache, kv_block_bytes
from runtime.lora import AdapterStack, LinearSource, RowAdapters


@dataclass
class SequenceChunk:
    """`length` new tokens of one sequence, at positions `start .. start + length - 1`,
    computed with the LoRA `adapters` (adapter, scale) of that sequence."""

    cache: PagedKVCache
    start: int
    length: int
    adapters: AdapterStack = ()


@dataclass
class BatchLayout:
    """Which rows of the packed token array belong to which sequence, in order."""

    chunks: list[SequenceChunk]

    def __post_init__(self) -> None:
        offsets = np.cumsum([0] + [c.length for c in self.chunks])
        # (first row, end row, chunk) per sequence; layers walk this once each
        self.spans = [(int(offsets[i]), int(offsets[i + 1]), c) for i, c in enumerate(self.chunks)]
        # what attention derives from the layout once per forward pass (slots, groups)
        self.plans: dict[Any, Any] = {}
        # the rows each LoRA adapter applies to; None (nothing to do) without adapters
        self.lora = RowAdapters.for_spans([(s, e, c.adapters) for s, e, c in self.spans])

    def positions(self) -> np.ndarray:
        return np.concatenate([np.arange(c.start, c.start + c.length) for c in self.chunks])

    def commit(self) -> None:
        """Record in each cache that the forward pass stored its tokens."""
        for chunk in self.chunks:
            chunk.cache.commit(chunk.start + chunk.length)


def rms_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis without its weight (folded into the next matmul). One
    formula for any number of rows: a row's result must not depend on its batch (a BLAS
    dot for a lone row rounded differently from einsum's per-row sums)."""
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


def rope_tables(
    positions: np.ndarray, inv_freq: np.ndarray, scale: float = 1.0, mscale: float = 1.0
):
    """cos/sin `[T, 1, n_rot/2]` for the given positions (linear scaling divides them);
    `mscale` multiplies both (LongRoPE's attention factor: the rotated dims only)."""
    angles = np.outer(positions.astype(np.float64) / scale, inv_freq)  # [T, n_rot/2]
    cos, sin = np.cos(angles), np.sin(angles)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    return cos.astype(np.float32)[:, None], sin.astype(np.float32)[:, None]


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """NeoX rotation of `x` `[T, heads, Dh]`: dims i and i + n_rot/2 form a pair."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rotated = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    if 2 * half == x.shape[-1]:
        return rotated
    return np.concatenate([rotated, x[..., 2 * half :]], axis=-1)


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


SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE


def swiglu_oai_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """gpt-oss's clamped GLU (ggml_swiglu_oai): x = min(gate, 7), x * sigmoid(1.702 x) *
    (clip(up, -7, 7) + 1), as ggml writes it: x / (1 + e^(-1.702 x))."""
    x = np.minimum(gate, np.float32(SWIGLU_OAI_LIMIT))
    out = x * np.float32(-SWIGLU_OAI_ALPHA)
    np.exp(out, out=out)
    out += 1.0
    np.divide(x, out, out=out)
    out *= np.clip(up, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT) + np.float32(1.0)
    return out


def linear(x: np.ndarray, weight: Weight, layout: BatchLayout | None = None) -> np.ndarray:
    """`x` `[T, in]` through `weight` `[out, in]` -> `[T, out]`, however the backend stores it;
    with a `layout`, each row also gets the LoRA deltas of its own sequence's adapters."""
    out = weight(x)
    if layout is not None and layout.lora is not None:
        out = layout.lora.apply(weight, x, out)
    return out


def normed_linear(
    x: np.ndarray, eps: float, weight: Weight, layout: BatchLayout, normalize: Callable
) -> np.ndarray:
    """`linear(normalize(x, eps), weight, layout)`: the RMSNorm (its weight folded into
    `weight`) before a layer's first two products. A weight with `normed(x, eps)`
    (runtime/kernels/torch_backend.py `LowBitWeight`) normalizes each row as its kernel
    reads it, so no normalized copy is made: ~12 us of numpy for a decode row, twice a
    layer. Every row takes that path whatever shares its batch; LoRA deltas are added from
    `normalize`'s rows."""
    normed = getattr(weight, "normed", None)
    if normed is None:
        return linear(normalize(x, eps), weight, layout)
    out = normed(x, eps)
    if layout is not None and layout.lora is not None:
        out = layout.lora.apply(weight, normalize(x, eps), out)
    return out


def gated_mlp(
    gate_up: np.ndarray, w_down: Weight, activation_mul, layout: BatchLayout
) -> np.ndarray:
    """down(act(gate) * up) from the fused gate and up product `gate_up` `[T, 2F]`."""
    ffn_dim = gate_up.shape[1] // 2
    hidden = activation_mul(gate_up[:, :ffn_dim], gate_up[:, ffn_dim:])  # [T, F]
    return linear(hidden, w_down, layout)  # [T, F] -> [T, D]


def sigmoid(x: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x) (a MoE router's gating, a DeltaNet's beta, a shared expert's gate)."""
    return 1.0 / (1.0 + np.exp(-x))


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
    (`output`, which shares the embedding's storage when tied), and its size. Subclasses set
    `args` (with n_layers, n_kv_heads, head_dim, context_length, dim), `embed`, `output`,
    `norm`, `layers` (each with the `Weight`s `wqkv`, `wo`, `w_gate_up`, `w_down`).
    """

    args: Any
    embed: Embedding  # [V, D]
    output: Weight  # [V, D]
    norm: np.ndarray
    layers: list[Any]
    # set by `load_model`: GGUF's general.architecture, and where each GGUF tensor went in
    # the linear weights (runtime/lora.py maps adapters the same way)
    architecture: str
    linear_sources: dict[str, LinearSource]
    ops: Any  # models/ops.py: host (numpy) or tensor (torch on a device) operations

    @property
    def context_length(self) -> int:
        return self.args.context_length

    @property
    def vocab_size(self) -> int:
        return self.output.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed.shape[1]

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, KV heads, head dim): what a KV cache of this model holds per token
        (where layers differ, `kv_layer_shapes`: these the most of any)."""
        return self.args.n_layers, self.args.n_kv_heads, self.args.head_dim

    @property
    def kv_layer_shapes(self) -> list[tuple[int, int]] | None:
        """Each layer's (KV heads, head dim) where layers differ (None: all `kv_shape`'s)."""
        return None

    @property
    def kv_block_bytes(self) -> int:
        """Bytes one block of `BLOCK_SIZE` tokens takes in this model's KV pool."""
        n_layers, n_kv_heads, head_dim = self.kv_shape
        shapes = self.kv_layer_shapes or [(n_kv_heads, head_dim)] * n_layers
        return kv_block_bytes(shapes, self.kv_sources, self.ops.kv_value_bytes)

    @property
    def kv_sources(self) -> list[int] | None:
        """The layer whose keys and values each layer reads (None: every layer its own)."""
        return None

    @property
    def kv_windows(self) -> list[int | None]:
        """Each layer's sliding attention window (None: it sees the whole context)."""
        return [getattr(layer, "window", None) for layer in self.layers]

    def _kv_layout(self) -> dict[str, Any]:
        """What a block pool of this model takes beside its shape: each layer's window,
        KV shape and source, and the device's storage and bytes a value."""
        return dict(
            windows=self.kv_windows,
            storage=self.ops.kv_storage,
            value_bytes=self.ops.kv_value_bytes,
            layer_shapes=self.kv_layer_shapes,
            kv_sources=self.kv_sources,
        )

    def new_kv_pool(self, max_tokens: int) -> BlockPool:
        """A block pool of this model's shape holding `max_tokens` positions (the engine
        sizes its shared pool by memory instead: `BlockPool.for_budget`)."""
        n_blocks = -(-max_tokens // BLOCK_SIZE)
        return BlockPool(*self.kv_shape, n_blocks, **self._kv_layout())

    def kv_pool_for_budget(self, memory_bytes: int) -> BlockPool:
        """The engine's shared pool: as many blocks as `memory_bytes` holds, on the device
        the forward pass runs on."""
        return BlockPool.for_budget(*self.kv_shape, memory_bytes, **self._kv_layout())

    def new_cache(self, max_tokens: int, pool: BlockPool | None = None) -> PagedKVCache:
        """A sequence's cache with room for `max_tokens` positions, in `pool` or in a pool
        of its own (single-sequence helpers: prompt logprobs, embeddings, tests)."""
        cache = PagedKVCache(pool or self.new_kv_pool(max_tokens))
        cache.reserve(max_tokens)
        return cache

    def run_layers(self, x: np.ndarray, layout: BatchLayout, rope: Any) -> np.ndarray:
        """The embedded tokens `x` `[T, D]` through every layer, then the final norm; the
        caches then hold this pass's tokens. `rope` is what the layers take (tables, or
        Gemma's {sliding: tables})."""
        for layer in self.layers:
            x = layer(x, layout, rope)
        layout.commit()
        return self.ops.rms_norm(x, self.norm, self.args.norm_eps)

    def logits(self, hidden: np.ndarray, exact: Exact = None) -> np.ndarray:
        """`[N, D]` -> row-major `[N, V]`, as the sampler's per-row reductions want it (a
        device tensor under the tensor ops: the sampler copies back only what it needs).
        `exact` (a bool per row, or True): rows a user sees or samples from, which take the
        file's precision where the head is cheaper (runtime/kernels/heads.py)."""
        return head_logits(self.output, hidden, exact)

    def weight_kinds(self) -> dict[str, int]:
        """How many weights each kernel got, e.g. {"int4": 120, "int8": 1}."""
        kinds: dict[str, int] = {}
        weights = [self.output] + [w for layer in self.layers for w in _layer_weights(layer)]
        for weight in weights:
            kinds[weight.kind] = kinds.get(weight.kind, 0) + 1
        return kinds

    @property
    def nbytes(self) -> int:
        """Bytes of the weights as the backend keeps them (a head sharing the embedding's
        storage counts 0)."""
        total = self.embed.nbytes + self.output.nbytes + self.norm.nbytes
        for layer in self.layers:
            total += sum(w.nbytes for w in _layer_weights(layer))
        return total


def _layer_weights(layer: Any) -> list[Weight]:
    """A layer's linear weights: its own list where it has one (a MoE layer's experts)."""
    if hasattr(layer, "weights"):
        return layer.weights()
    return [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down]
