"""Llama-family decoder (Llama 2/3, TinyLlama, Mistral, SmolLM2): GQA, SwiGLU, RMSNorm, rope.

GGUF stores llama's q/k rows permuted for llama.cpp's adjacent-pair rope; we permute them
back at load so that attention can use the NeoX half-split rotation on contiguous halves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.gguf_file import GGUFFile
from runtime.models.attention import attend_layout
from runtime.models.base import (
    BatchLayout,
    DecoderModel,
    apply_rope,
    gated_mlp,
    linear,
    pack_linear,
    rms_norm,
    rms_normalize,
    rope_inv_freq,
    rope_tables,
    silu_mul,
)


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


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the GGUF converter's q/k row interleave: rows (2i, 2i+1) -> (i, i + half)."""
    out_dim, in_dim = w.shape
    half = out_dim // n_heads // 2
    return w.reshape(n_heads, half, 2, in_dim).swapaxes(1, 2).reshape(out_dim, in_dim)


class LlamaLayer:
    def __init__(self, f: GGUFFile, i: int, args: LlamaArgs) -> None:
        p = f"blk.{i}."
        self.index, self.args = i, args
        # the 1/sqrt(Dh) attention scale goes into q's rows, the norm weights into the inputs
        q = unpermute_rows(f.tensor(p + "attn_q.weight"), args.n_heads) / np.sqrt(args.head_dim)
        k = unpermute_rows(f.tensor(p + "attn_k.weight"), args.n_kv_heads)
        v = f.tensor(p + "attn_v.weight")
        self.wqkv = pack_linear([q, k, v], f.tensor(p + "attn_norm.weight"))  # [(H+2Hkv)*Dh, D]
        self.wo = f.tensor(p + "attn_output.weight")  # [D, H*Dh]
        gate_up = [f.tensor(p + f"ffn_{n}.weight") for n in ("gate", "up")]
        self.w_gate_up = pack_linear(gate_up, f.tensor(p + "ffn_norm.weight"))  # [2F, D]
        self.w_down = f.tensor(p + "ffn_down.weight")  # [D, F]

    def __call__(self, x: np.ndarray, layout: BatchLayout, rope: tuple) -> np.ndarray:
        eps = self.args.norm_eps
        h = x + self.attention(rms_normalize(x, eps), layout, rope)
        h += self.mlp(rms_normalize(h, eps))  # in place: h is this layer's own buffer
        return h

    def attention(self, x: np.ndarray, layout: BatchLayout, rope: tuple) -> np.ndarray:
        a, t = self.args, x.shape[0]
        n_qk = a.n_heads + a.n_kv_heads
        qkv = linear(x, self.wqkv)  # [T, D] -> [T, (H+2Hkv)*Dh]
        qk = apply_rope(qkv[:, : n_qk * a.head_dim].reshape(t, n_qk, a.head_dim), *rope)
        q, k = qk[:, : a.n_heads], qk[:, a.n_heads :]  # [T, H, Dh], [T, Hkv, Dh]
        v = qkv[:, n_qk * a.head_dim :].reshape(t, a.n_kv_heads, a.head_dim)
        out = attend_layout(self.index, q, k, v, layout)
        return linear(out, self.wo)  # [T, H*Dh] -> [T, D]

    def mlp(self, x: np.ndarray) -> np.ndarray:
        return gated_mlp(x, self.w_gate_up, self.w_down, silu_mul)


class LlamaModel(DecoderModel):
    """The whole decoder; `forward` returns final-normed hidden states, `logits` projects."""

    def __init__(self, f: GGUFFile) -> None:
        self.args = a = LlamaArgs.from_gguf(f)
        self.embed = f.tensor("token_embd.weight")  # [V, D]
        self.output = f.tensor("output.weight") if f.has_tensor("output.weight") else self.embed
        self.norm = f.tensor("output_norm.weight")
        factors = f.tensor("rope_freqs.weight") if f.has_tensor("rope_freqs.weight") else None
        self.inv_freq = rope_inv_freq(a.n_rot, a.rope_base, factors)
        self.layers = [LlamaLayer(f, i, a) for i in range(a.n_layers)]

    def forward(self, tokens: np.ndarray, layout: BatchLayout) -> np.ndarray:
        x = self.embed[tokens]  # [T] -> [T, D]
        rope = rope_tables(layout.positions(), self.inv_freq, self.args.rope_scale)
        for layer in self.layers:
            x = layer(x, layout, rope)
        layout.commit()
        return rms_norm(x, self.norm, self.args.norm_eps)
