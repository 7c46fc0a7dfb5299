"""Llama-family decoder (Llama 2/3, TinyLlama, Mistral, SmolLM2): GQA, SwiGLU, RMSNorm, rope.

GGUF stores llama's q/k rows permuted for llama.cpp's adjacent-pair rope; we permute them
back at load so that attention can use the NeoX half-split rotation on contiguous halves.
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


@dataclass
class LlamaArgs:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_base: float
    rope_scale: float
    n_rot: int
    context_length: int
    vocab_size: int

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> LlamaArgs:
        dim, n_heads = int(f.require("embedding_length")), int(f.require("attention.head_count"))
        head_dim = dim // n_heads
        return cls(
            n_layers=int(f.require("block_count")),
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=int(f.arch_value("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            ffn_dim=int(f.require("feed_forward_length")),
            norm_eps=float(f.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(f.arch_value("rope.freq_base", 10000.0)),
            rope_scale=f.linear_rope_scale(),
            n_rot=int(f.arch_value("rope.dimension_count", head_dim)),
            context_length=int(f.require("context_length")),
            vocab_size=len(f.metadata["tokenizer.ggml.tokens"]),
        )


def unpermute_order(out_dim: int, n_heads: int) -> np.ndarray:
    """Row order undoing the GGUF converter's q/k interleave: rows (2i, 2i+1) -> (i, i + half)
    within each head. A row order applies to float rows and to quantized rows alike."""
    half = out_dim // n_heads // 2
    return np.arange(out_dim).reshape(n_heads, half, 2).swapaxes(1, 2).reshape(out_dim)


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w[unpermute_order(w.shape[0], n_heads)]


class LlamaLayer:
    def __init__(self, f: GGUFFile, i: int, args: LlamaArgs, backend: Backend, ops) -> None:
        p = f"blk.{i}."
        self.index, self.args, self.ops = i, args, ops
        # the 1/sqrt(Dh) attention scale goes into q's rows, the norm weights into the inputs
        q_rows, kv_rows = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        qkv = [
            TensorPart(
                p + "attn_q.weight",
                unpermute_order(q_rows, args.n_heads),
                1 / float(np.sqrt(args.head_dim)),
            ),
            TensorPart(p + "attn_k.weight", unpermute_order(kv_rows, args.n_kv_heads)),
            TensorPart(p + "attn_v.weight"),
        ]
        self.wqkv, self.wo, self.w_gate_up, self.w_down = block_linears(f, p, backend, qkv)

    def __call__(self, x: np.ndarray, layout: BatchLayout, rope: tuple) -> np.ndarray:
        h = x + self.attention(x, layout, rope)
        h += self.mlp(h, layout)  # in place: h is this layer's own buffer
        return h

    def attention(self, x: np.ndarray, layout: BatchLayout, rope: tuple) -> np.ndarray:
        """Attention over the RMS-normalized `x` (the norm is the product's: normed_linear)."""
        a, t, ops = self.args, x.shape[0], self.ops
        n_qk = a.n_heads + a.n_kv_heads
        # [T, D] -> [T, (H+2Hkv)*Dh]
        qkv = normed_linear(x, a.norm_eps, self.wqkv, layout, ops.rms_normalize)
        qk = self.ops.apply_rope(qkv[:, : n_qk * a.head_dim].reshape(t, n_qk, a.head_dim), *rope)
        q, k = qk[:, : a.n_heads], qk[:, a.n_heads :]  # [T, H, Dh], [T, Hkv, Dh]
        v = qkv[:, n_qk * a.head_dim :].reshape(t, a.n_kv_heads, a.head_dim)
        out = self.ops.attend(self.index, q, k, v, layout)
        return linear(out, self.wo, layout)  # [T, H*Dh] -> [T, D]

    def mlp(self, x: np.ndarray, layout: BatchLayout) -> np.ndarray:
        """The MLP over the RMS-normalized `x` (the norm is the product's: normed_linear)."""
        eps, ops = self.args.norm_eps, self.ops
        gate_up = normed_linear(x, eps, self.w_gate_up, layout, ops.rms_normalize)  # [T, 2F]
        return gated_mlp(gate_up, self.w_down, ops.silu_mul, layout)


class LlamaModel(DecoderModel):
    """The whole decoder; `forward` returns final-normed hidden states, `logits` projects."""

    def __init__(self, f: GGUFFile, backend: Backend) -> None:
        self.args = a = LlamaArgs.from_gguf(f)
        self.ops = ops = array_ops(backend)
        self.embed = backend.embedding(f, "token_embd.weight")  # [V, D]
        if f.has_tensor("output.weight"):
            self.output = backend.head(f, "output.weight")
        else:
            self.output = backend.head(f, "token_embd.weight", tied=self.embed)
        self.norm = ops.vector(f.tensor("output_norm.weight"))
        factors = f.tensor("rope_freqs.weight") if f.has_tensor("rope_freqs.weight") else None
        self.inv_freq = rope_inv_freq(a.n_rot, a.rope_base, factors)
        self.layers = [LlamaLayer(f, i, a, backend, ops) for i in range(a.n_layers)]

    def forward(self, tokens: np.ndarray, layout: BatchLayout) -> np.ndarray:
        self.ops.prepare(layout, self.kv_windows)
        x = self.embed(tokens)  # [T] -> [T, D]
        rope = self.ops.rope_tables(layout.positions(), self.inv_freq, self.args.rope_scale)
        return self.run_layers(x, layout, rope)
