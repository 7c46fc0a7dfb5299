"""Gemma 3 decoder: q/k RMSNorm, pre and post norms around attention and FFN, GELU-tanh
gated FFN, embeddings scaled by sqrt(dim), and interleaved attention: five sliding-window
layers (their own rope base) to every global layer.

The GGUF converter stores Gemma's norm weights as (1 + w), so `rms_norm` multiplies as-is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.gguf_file import GGUFFile
from runtime.kernels import Backend, TensorPart
from runtime.models.base import (
    BatchLayout,
    DecoderModel,
    block_linears,
    gated_mlp,
    linear,
    normed_linear,
    rope_inv_freq,
)
from runtime.models.ops import array_ops

SLIDING_WINDOW_PATTERN = 6  # every 6th layer is global (llama.cpp and HF agree)
LOCAL_ROPE_BASE = 10000.0


@dataclass
class Gemma3Args:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_base: float
    rope_scale: float
    local_rope_base: float
    sliding_window: int
    context_length: int

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Gemma3Args:
        n_heads = int(f.require("attention.head_count"))
        return cls(
            n_layers=int(f.require("block_count")),
            dim=int(f.require("embedding_length")),
            n_heads=n_heads,
            n_kv_heads=int(f.arch_value("attention.head_count_kv", n_heads)),
            head_dim=int(f.require("attention.key_length")),
            ffn_dim=int(f.require("feed_forward_length")),
            norm_eps=float(f.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_base=float(f.arch_value("rope.freq_base", 1_000_000.0)),
            rope_scale=f.linear_rope_scale(),
            local_rope_base=float(f.arch_value("rope.freq_base_swa", LOCAL_ROPE_BASE)),
            sliding_window=int(f.require("attention.sliding_window")),
            context_length=int(f.require("context_length")),
        )

    def is_sliding(self, layer: int) -> bool:
        return (layer + 1) % SLIDING_WINDOW_PATTERN != 0


class Gemma3Layer:
    def __init__(self, f: GGUFFile, i: int, args: Gemma3Args, backend: Backend, ops) -> None:
        p = f"blk.{i}."
        self.index, self.args, self.ops = i, args, ops
        self.sliding = args.is_sliding(i)  # picks the local rope base as well as the window
        self.window = args.sliding_window if self.sliding else None
        self.post_attn_norm = ops.vector(f.tensor(p + "post_attention_norm.weight"))
        self.post_ffn_norm = ops.vector(f.tensor(p + "post_ffw_norm.weight"))
        # the 1/sqrt(Dh) attention scale goes into q's norm, the pre-norms into the matmuls
        self.q_norm = ops.vector(f.tensor(p + "attn_q_norm.weight") / np.sqrt(args.head_dim))
        self.k_norm = ops.vector(f.tensor(p + "attn_k_norm.weight"))
        qkv = [TensorPart(p + f"attn_{n}.weight") for n in "qkv"]
        self.wqkv, self.wo, self.w_gate_up, self.w_down = block_linears(f, p, backend, qkv)

    def __call__(self, x: np.ndarray, layout: BatchLayout, ropes: dict[bool, tuple]) -> np.ndarray:
        eps, ops = self.args.norm_eps, self.ops
        attn = self.attention(x, layout, ropes[self.sliding])
        h = x + ops.rms_norm(attn, self.post_attn_norm, eps)
        return h + ops.rms_norm(self.mlp(h, layout), self.post_ffn_norm, eps)

    def attention(self, x: np.ndarray, layout: BatchLayout, rope: tuple) -> np.ndarray:
        """Attention over the RMS-normalized `x` (the norm is the product's: normed_linear)."""
        a, t, eps = self.args, x.shape[0], self.args.norm_eps
        q_end, k_end = a.n_heads * a.head_dim, (a.n_heads + a.n_kv_heads) * a.head_dim
        # [T, D] -> [T, (H+2Hkv)*Dh]
        qkv = normed_linear(x, eps, self.wqkv, layout, self.ops.rms_normalize)
        q = qkv[:, :q_end].reshape(t, a.n_heads, a.head_dim)
        k = qkv[:, q_end:k_end].reshape(t, a.n_kv_heads, a.head_dim)
        v = qkv[:, k_end:].reshape(t, a.n_kv_heads, a.head_dim)
        ops = self.ops
        q = ops.apply_rope(ops.rms_norm(q, self.q_norm, eps), *rope)  # [T, H, Dh]
        k = ops.apply_rope(ops.rms_norm(k, self.k_norm, eps), *rope)  # [T, Hkv, Dh]
        out = ops.attend(self.index, q, k, v, layout, self.window)
        return linear(out, self.wo, layout)  # [T, H*Dh] -> [T, D]

    def mlp(self, x: np.ndarray, layout: BatchLayout) -> np.ndarray:
        """The MLP over the RMS-normalized `x` (the norm is the product's: normed_linear)."""
        eps, ops = self.args.norm_eps, self.ops
        gate_up = normed_linear(x, eps, self.w_gate_up, layout, ops.rms_normalize)  # [T, 2F]
        return gated_mlp(gate_up, self.w_down, ops.gelu_tanh_mul, layout)


class Gemma3Model(DecoderModel):
    """The whole decoder; `forward` returns final-normed hidden states, `logits` projects."""

    def __init__(self, f: GGUFFile, backend: Backend) -> None:
        self.args = a = Gemma3Args.from_gguf(f)
        self.ops = ops = array_ops(backend)
        self.embed = backend.embedding(f, "token_embd.weight")  # [V, D]
        self.output = backend.head(f, "token_embd.weight", tied=self.embed)  # tied output head
        self.norm = ops.vector(f.tensor("output_norm.weight"))
        self.embed_scale = np.float32(np.sqrt(a.dim))
        self.global_inv_freq = rope_inv_freq(a.head_dim, a.rope_base)
        self.local_inv_freq = rope_inv_freq(a.head_dim, a.local_rope_base)
        self.layers = [Gemma3Layer(f, i, a, backend, ops) for i in range(a.n_layers)]

    def forward(self, tokens: np.ndarray, layout: BatchLayout) -> np.ndarray:
        self.ops.prepare(layout, self.kv_windows)
        x = self.embed(tokens) * self.embed_scale  # [T] -> [T, D]
        positions = layout.positions()
        ropes = {
            False: self.ops.rope_tables(positions, self.global_inv_freq, self.args.rope_scale),
            True: self.ops.rope_tables(positions, self.local_inv_freq),
        }
        return self.run_layers(x, layout, ropes)
