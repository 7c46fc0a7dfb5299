"""Qwen 3.5 (dense): Gated DeltaNet layers (runtime/models/delta_net.py) beside full
attention ones (`attention.recurrent_layers`, else every `full_attention_interval`-th layer
attends), each followed by a SwiGLU FFN whose pre-norm GGUF names post_attention_norm.

The full-attention layers: q's projection holds each head's query then its output gate
(sigmoid, times attention's output before attn_output); RMSNorm on q and k per head; NeoX
rope on the first `rope.dimension_count` dims of each head (Qwen 3.5's interleaved MRoPE,
whose sections all take a text token's one position: plain rope for text). Norm weights are
stored with Qwen's +1 already added by the converter. Multi-token-prediction layers after
the trunk (`nextn_predict_layers`) are not run. llama.cpp: src/models/qwen35.cpp;
convert_hf_to_gguf.py: conversion/qwen.py `Qwen3_5TextModel`.

Host path only: the tensor forward pass (a device's, torch_forward) is refused at load by
name, as is Qwen 3.5's MoE (qwen35moe is not registered). A hybrid model's sequences carry
recurrent state beside their KV blocks, so its engine runs without the prefix cache
(runtime/engine.py), and a preempted sequence is recomputed from its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.errors import ModelFormatError
from runtime.gguf_file import GGUFFile
from runtime.kernels import Backend, TensorPart
from runtime.models.base import BatchLayout, linear
from runtime.models.delta_net import DeltaNetArgs, GatedDeltaNet
from runtime.models.layers import Block, BlockShape, Decoder, DecoderArgs


@dataclass
class Qwen35Args(DecoderArgs):
    recurrent: tuple[bool, ...] = ()  # per layer: a Gated DeltaNet layer
    delta_net: DeltaNetArgs | None = None

    def rope(self, layer: int) -> Any:
        return None if self.recurrent[layer] else super().rope(layer)


def recurrent_layers(f: GGUFFile, n_layers: int) -> tuple[bool, ...]:
    """As llama.cpp's qwen35 loader: `attention.recurrent_layers`, else all but every
    `full_attention_interval`-th layer (default 4)."""
    flags = f.arch_value("attention.recurrent_layers")
    if flags is not None:
        return tuple(bool(v) for v in list(flags)[:n_layers])
    interval = int(f.arch_value("full_attention_interval", 4))
    return tuple((i + 1) % interval != 0 for i in range(n_layers))


def _read_args(f: GGUFFile) -> Qwen35Args:
    n_layers = int(f.require("block_count")) - int(f.arch_value("nextn_predict_layers", 0))
    args = Qwen35Args.read(f, norm_eps=1e-6, rope_base=10000.0)
    args.n_layers = n_layers
    args.recurrent = recurrent_layers(f, n_layers)
    args.delta_net = DeltaNetArgs.read(f, args.norm_eps)
    return args


class _FFN:
    """The SwiGLU FFN after the norm GGUF names post_attention_norm."""

    def build_mlp(self, f: GGUFFile, p: str, backend: Backend) -> None:
        parts = [TensorPart(p + "ffn_gate.weight"), TensorPart(p + "ffn_up.weight")]
        self.ffn_norm = self.ops.vector(f.tensor(p + "post_attention_norm.weight"))
        self.w_gate_up = backend.linear(f, parts)  # [2F, D]
        self.w_down = backend.linear(f, [TensorPart(p + "ffn_down.weight")])  # [D, F]


class Qwen35AttentionBlock(_FFN, Block):
    """A full-attention layer: q with its output gate, q/k norms, partial rope."""

    def attention(self, x, layout: BatchLayout, rope: tuple | None, q_temperature=None):
        a, t, ops = self.args, x.shape[0], self.ops
        q_end = 2 * a.n_heads * a.head_dim
        k_end = q_end + a.n_kv_heads * a.head_dim
        qkv = self.project(x, self.wqkv, layout, self.attn_norm)  # [T, D] -> [T, 2H*Dh + 2Hkv*Dh]
        q_gate = qkv[:, :q_end].reshape(t, a.n_heads, 2, a.head_dim)  # per head: q, gate
        q = q_gate[:, :, 0].reshape(t, a.n_heads * a.head_dim)
        gate = q_gate[:, :, 1].reshape(t, a.n_heads * a.head_dim)
        v = qkv[:, k_end:].reshape(t, a.n_kv_heads, a.head_dim)
        q, k = self._normed_qk(q, qkv[:, q_end:k_end])  # [T, H|Hkv, Dh]
        q, k = (ops.apply_rope(y, *rope) for y in (q, k))
        out = ops.attend(self.index, q, k, v, layout, None, None)  # [T, H*Dh]
        out = out / (1.0 + np.exp(-gate))  # times sigmoid(gate)
        return linear(out, self.wo, layout)  # [T, H*Dh] -> [T, D]


class Qwen35DeltaNetBlock(_FFN, Block):
    """A Gated DeltaNet layer: `h = x + delta_net(norm(x)); h + mlp(norm(h))`."""

    def __init__(
        self, f: GGUFFile, i: int, args: Qwen35Args, backend: Backend, ops, shape: BlockShape
    ) -> None:
        p = f"blk.{i}."
        self.index, self.args, self.ops, self.shape = i, args, ops, shape
        self.window = self.rope_key = None
        self.pre_norm, self.attn_norm = True, ops.vector(f.tensor(p + "attn_norm.weight"))
        self.post_attn_norm = self.post_ffn_norm = None
        self.delta_net = GatedDeltaNet(f, p, args.delta_net, backend)
        self.activation_mul = ops.silu_mul
        self.build_mlp(f, p, backend)

    def weights(self) -> list[Any]:
        return [*self.delta_net.weights(), self.w_gate_up, self.w_down]

    def attention(self, x, layout: BatchLayout, rope: tuple | None, q_temperature=None):
        # [T, D] -> [T, C+Vd+2Hv]
        projected = self.project(x, self.delta_net.w_in, layout, self.attn_norm)
        return self.delta_net(projected, layout)


class Qwen35Model(Decoder):
    # the pre-norms multiply the activations: folded, they re-round fp16 weights (the torch
    # kernels' logits 1.4e-3 of the largest from transformers' float32 folded, 6.3e-6 unfolded)
    shape = BlockShape(qk_norm="head", fold_norms=False)
    recurrent = True  # sequences carry state beside their KV: no prefix cache

    @staticmethod
    def read_args(f: GGUFFile) -> Qwen35Args:
        return _read_args(f)

    def __init__(self, f: GGUFFile, backend: Backend) -> None:
        if getattr(backend, "device", None) is not None:
            raise ModelFormatError(
                f"{f.path.name}: qwen35's Gated DeltaNet layers run on the host path only; "
                "the tensor forward pass (torch_forward, a GPU) is not supported for it yet"
            )
        super().__init__(f, backend)

    def block(self, f, i, args, backend, ops, shape) -> Block:  # type: ignore[override]
        layer = Qwen35DeltaNetBlock if args.recurrent[i] else Qwen35AttentionBlock
        return layer(f, i, args, backend, ops, shape)

    @property
    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        """The full-attention layers' KV; a DeltaNet layer keeps none (a minimal stand-in)."""
        a = self.args
        return [(1, 1) if r else (a.n_kv_heads, a.head_dim) for r in a.recurrent]
