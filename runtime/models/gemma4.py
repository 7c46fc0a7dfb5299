"""Gemma 4 (dense text): Gemma 3's layer (pre and post norms, q/k RMSNorm per head,
GELU-tanh gated FFN, embeddings times sqrt(dim)) with

- no 1/sqrt(Dh) on q.k (its q/k norms set the scale: llama.cpp's f_attention_scale 1.0);
- v RMS-normalized per head without a weight; where a layer has no attn_v (the 31B's
  full layers: attention_k_eq_v) v is k's projection before k's norm and rope;
- sliding and full layers of their own head size (attention.key_length_swa / key_length)
  and, in some files, KV head count (a per-layer attention.head_count_kv);
- sliding layers rotate `rope.dimension_count_swa` dims at rope.freq_base_swa; full layers
  rotate their whole head at rope.freq_base with rope_freqs dividing each frequency
  (Gemma 4's "proportional" rope: factor 1 for the rotated quarter, 1e30 for the rest, so
  those pairs stay put);
- each layer's output, residual included, times its layer_output_scale.

llama.cpp: src/models/gemma4.cpp; conversion/gemma.py `Gemma4Model` (norm weights stored
as the scale itself). The KV pool keeps each layer in its own shape (`kv_layer_shapes`).
Not supported, refused by name at load: per-layer embeddings and KV shared across layers
(E2B, E4B), mixture-of-experts layers (26B-A4B).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from runtime.errors import ModelFormatError
from runtime.gguf_file import GGUFFile
from runtime.kernels import Backend, TensorPart
from runtime.models.base import BatchLayout, linear, rope_inv_freq
from runtime.models.layers import (
    GLOBAL,
    Block,
    BlockShape,
    Decoder,
    DecoderArgs,
    sliding_layers,
)

LOCAL = "local"  # the sliding layers' rope key


@dataclass
class Gemma4Args(DecoderArgs):
    """`head_dim` and `n_kv_heads` are the most of any layer (the model's `kv_shape`);
    `head_dims` and `kv_heads` each layer's own."""

    local_rope_base: float = 10000.0
    local_n_rot: int = 0
    head_dims: tuple[int, ...] = ()
    kv_heads: tuple[int, ...] = ()

    def rope(self, layer: int) -> Hashable:
        return LOCAL if self.sliding[layer] else GLOBAL

    def layer(self, i: int) -> Gemma4Args:
        """Layer `i`'s own args: its head size and KV heads."""
        return replace(self, head_dim=self.head_dims[i], n_kv_heads=self.kv_heads[i])


def _refuse_unsupported(f: GGUFFile) -> None:
    name = f.path.name
    if int(f.arch_value("embedding_length_per_layer_input", 0)) > 0 or f.has_tensor(
        "per_layer_token_embd.weight"
    ):
        raise ModelFormatError(
            f"{name}: Gemma 4's per-layer embeddings (per_layer_token_embd, as in E2B and "
            "E4B) are not supported"
        )
    if int(f.arch_value("attention.shared_kv_layers", 0)) > 0:
        raise ModelFormatError(
            f"{name}: Gemma 4's KV cache shared across layers (attention.shared_kv_layers, "
            "as in E2B and E4B) is not supported"
        )
    n_layers = int(f.require("block_count"))
    if int(f.arch_value("expert_count", 0)) > 0 or any(
        f.has_tensor(f"blk.{i}.ffn_gate_inp.weight") for i in range(n_layers)
    ):
        raise ModelFormatError(
            f"{name}: Gemma 4's mixture-of-experts layers (as in 26B-A4B) are not supported"
        )
    for key in ("attention.head_count", "feed_forward_length"):
        if len(set(np.ravel(f.require(key)))) != 1:
            raise ModelFormatError(f"{name}: gemma4 with a per-layer {key} is not supported")
    if f.arch_value("rope.scaling.type") == "yarn":
        raise ModelFormatError(f"{name}: rope scaling 'yarn' is not supported")
    for suffix in ("", "_swa"):
        key, value = (
            f.require("attention.key_length" + suffix),
            f.arch_value("attention.value_length" + suffix),
        )
        if value is not None and int(value) != int(key):
            raise ModelFormatError(f"{name}: Gemma 4 needs key_length{suffix} == value_length")


def _per_layer(value: Any, n_layers: int) -> tuple[int, ...]:
    """A GGUF value given once for all layers or as one per layer."""
    values = np.ravel(value).astype(int)
    return tuple(int(v) for v in np.broadcast_to(values, (n_layers,)))


def _read_args(f: GGUFFile) -> Gemma4Args:
    _refuse_unsupported(f)
    n_layers, dim = int(f.require("block_count")), int(f.require("embedding_length"))
    f.require("attention.sliding_window_pattern")  # llama.cpp reads it as required
    sliding = sliding_layers(f, n_layers, 0)
    full_dim, swa_dim = (
        int(f.require(k)) for k in ("attention.key_length", "attention.key_length_swa")
    )
    head_dims = tuple(swa_dim if s else full_dim for s in sliding)
    kv_heads = _per_layer(
        f.arch_value("attention.head_count_kv", f.require("attention.head_count")), n_layers
    )
    final_cap = f.arch_value("final_logit_softcapping")
    args = Gemma4Args.read(
        f,
        norm_eps=1e-6,
        embed_scale=float(np.float32(np.sqrt(dim))),
        attn_scale=1.0,
        final_softcap=None if not final_cap else float(final_cap),
        sliding_window=int(f.require("attention.sliding_window")),
        sliding=sliding,
        local_rope_base=float(f.arch_value("rope.freq_base_swa", 10000.0)),
        local_n_rot=int(f.arch_value("rope.dimension_count_swa", swa_dim)),
        head_dims=head_dims,
        kv_heads=kv_heads,
    )
    args.head_dim, args.n_kv_heads = max(head_dims), max(kv_heads)
    return args


class Gemma4Block(Block):
    """A Gemma 4 layer; `args` are the model's, this layer's own taken from them."""

    def __init__(
        self, f: GGUFFile, i: int, args: Gemma4Args, backend: Backend, ops, shape: BlockShape
    ) -> None:
        p = f"blk.{i}."
        fused_or_v = f.has_tensor(p + "attn_v.weight") or f.has_tensor(p + "attn_qkv.weight")
        self.k_eq_v = not fused_or_v
        super().__init__(f, i, args.layer(i), backend, ops, shape)
        scale = p + "layer_output_scale.weight"
        self.out_scale = float(f.tensor(scale)[0]) if f.has_tensor(scale) else None

    def _qkv_parts(self, f: GGUFFile, p: str) -> list[TensorPart]:
        parts = super()._qkv_parts(f, p)
        return parts[:2] if self.k_eq_v else parts  # q, k: v is k's projection

    def __call__(self, x, layout: BatchLayout, ropes: dict) -> Any:
        out = super().__call__(x, layout, ropes)
        return out if self.out_scale is None else out * self.out_scale

    def attention(self, x, layout: BatchLayout, rope: tuple | None, q_temperature=None):
        a, t, ops = self.args, x.shape[0], self.ops
        q_end, k_end = a.n_heads * a.head_dim, (a.n_heads + a.n_kv_heads) * a.head_dim
        # [T, D] -> [T, (H+2Hkv)*Dh] ((H+Hkv)*Dh where v is k's projection)
        qkv = self.project(x, self.wqkv, layout, self.attn_norm)
        v = qkv[:, q_end:k_end] if self.k_eq_v else qkv[:, k_end:]
        v = ops.rms_normalize(v.reshape(t, a.n_kv_heads, a.head_dim), a.norm_eps)
        q, k = self._normed_qk(qkv[:, :q_end], qkv[:, q_end:k_end])  # [T, H|Hkv, Dh]
        q, k = (ops.apply_rope(y, *rope) for y in (q, k))
        out = ops.attend(self.index, q, k, v, layout, self.window, None)  # [T, H*Dh]
        return linear(out, self.wo, layout)  # [T, H*Dh] -> [T, D]


class Gemma4Model(Decoder):
    # the pre-norms unfolded: a fold re-rounds fp16 weights, which q.k unscaled magnifies
    shape = BlockShape(norms="pre_post", qk_norm="head", activation="gelu_tanh", fold_norms=False)
    block = Gemma4Block

    @staticmethod
    def read_args(f: GGUFFile) -> Gemma4Args:
        return _read_args(f)

    @property
    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        return list(zip(self.args.kv_heads, self.args.head_dims, strict=True))

    def rope_freqs(self, f: GGUFFile) -> dict[Hashable, tuple]:
        a = self.args
        factors = f.tensor("rope_freqs.weight") if f.has_tensor("rope_freqs.weight") else None
        return {
            GLOBAL: (rope_inv_freq(a.n_rot, a.rope_base, factors), a.rope_scale),
            LOCAL: (rope_inv_freq(a.local_n_rot, a.local_rope_base), a.rope_scale),
        }
