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
- each layer's output, residual included, times its layer_output_scale;
- E2B/E4B: per-layer embeddings (a token's row of per_layer_token_embd plus a projection
  of its embedding, one slice per layer, gating a small product added after the FFN) and
  the last attention.shared_kv_layers layers reading the keys and values of the last
  sliding or full layer before them (they compute q only);
- 26B-A4B: beside each layer's dense FFN (then post_ffw_norm_1) its experts on
  pre_ffw_norm_2's input (then post_ffw_norm_2), routed by softmax over the logits of the
  input RMS-normalized, over sqrt(dim), times ffn_gate_inp.scale; top k, weights summing
  to 1, each expert's output times its ffn_down_exps.scale.

llama.cpp: src/models/gemma4.cpp; conversion/gemma.py `Gemma4Model` (norm weights stored
as the scale itself). The KV pool keeps each layer in its own shape (`kv_layer_shapes`),
and a sharing layer none (`kv_sources`).
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
from runtime.models.moe import MoE, MoEArgs, _capturing, route

LOCAL = "local"  # the sliding layers' rope key
PER_LAYER = "per-layer inputs"  # beside the rope tables: [T, layers, E] (E2B/E4B)
SHARED_KV = "shared kv"  # beside them too: layer -> its k, v this step, for sharing layers


@dataclass
class Gemma4Args(DecoderArgs):
    """`head_dim` and `n_kv_heads` are the most of any layer (the model's `kv_shape`);
    `head_dims` and `kv_heads` each layer's own; `kv_sources[i]` the layer whose keys and
    values layer i attends over (itself, or for a sharing layer an earlier one)."""

    local_rope_base: float = 10000.0
    local_n_rot: int = 0
    head_dims: tuple[int, ...] = ()
    kv_heads: tuple[int, ...] = ()
    kv_sources: tuple[int, ...] = ()
    per_layer_dim: int = 0  # embedding_length_per_layer_input (0: no per-layer inputs)
    moe: MoEArgs | None = None  # the experts' (26B-A4B)

    def rope(self, layer: int) -> Hashable:
        return LOCAL if self.sliding[layer] else GLOBAL

    def layer(self, i: int) -> Gemma4Args:
        """Layer `i`'s own args: its head size and KV heads."""
        return replace(self, head_dim=self.head_dims[i], n_kv_heads=self.kv_heads[i])


def _check_supported(f: GGUFFile) -> None:
    name = f.path.name
    if len(set(np.ravel(f.require("attention.head_count")))) != 1:
        raise ModelFormatError(f"{name}: gemma4 with a per-layer head_count is not supported")
    if f.arch_value("rope.scaling.type") == "yarn":
        raise ModelFormatError(f"{name}: rope scaling 'yarn' is not supported")
    for suffix in ("", "_swa"):
        key = f.require("attention.key_length" + suffix)
        value = f.arch_value("attention.value_length" + suffix)
        if value is not None and int(value) != int(key):
            raise ModelFormatError(f"{name}: Gemma 4 needs key_length{suffix} == value_length")


def _per_layer(value: Any, n_layers: int) -> tuple[int, ...]:
    """A GGUF value given once for all layers or as one per layer."""
    values = np.ravel(value).astype(int)
    return tuple(int(v) for v in np.broadcast_to(values, (n_layers,)))


def _kv_sources(f: GGUFFile, sliding: tuple[bool, ...]) -> tuple[int, ...]:
    """llama.cpp's layer_reuse_cb: past the first n - shared_kv_layers layers, a sliding
    layer reads the second-last of those, a full layer the last."""
    n_layers = len(sliding)
    first_shared = n_layers - int(f.arch_value("attention.shared_kv_layers", 0))
    if first_shared == n_layers:
        return tuple(range(n_layers))
    if first_shared < 2 or sliding[first_shared - 1] or not sliding[first_shared - 2]:
        raise ModelFormatError(
            f"{f.path.name}: Gemma 4's shared KV layers need a sliding then a full layer "
            f"before them (layers {first_shared - 2} and {first_shared - 1})"
        )
    own = tuple(range(first_shared))
    return own + tuple(first_shared - (2 if s else 1) for s in sliding[first_shared:])


def _read_args(f: GGUFFile) -> Gemma4Args:
    _check_supported(f)
    n_layers, dim = int(f.require("block_count")), int(f.require("embedding_length"))
    f.require("attention.sliding_window_pattern")  # llama.cpp reads it as required
    sliding = sliding_layers(f, n_layers, 0)
    full_dim = int(f.require("attention.key_length"))
    swa_dim = int(f.require("attention.key_length_swa"))
    head_dims = tuple(swa_dim if s else full_dim for s in sliding)
    n_heads = f.require("attention.head_count")
    kv_heads = _per_layer(f.arch_value("attention.head_count_kv", n_heads), n_layers)
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
        kv_sources=_kv_sources(f, sliding),
        per_layer_dim=int(f.arch_value("embedding_length_per_layer_input", 0)),
        # llama.cpp's gemma4.cpp: softmax, the k weights normalized, no scale
        moe=None
        if not f.arch_value("expert_count")
        else MoEArgs.read(f, gating="softmax", norm_weights=True, weights_scale=1.0),
    )
    args.head_dim, args.n_kv_heads = max(head_dims), max(kv_heads)
    return args


class Gemma4Block(Block):
    """A Gemma 4 layer; `args` are the model's, this layer's own taken from them."""

    def __init__(
        self, f: GGUFFile, i: int, args: Gemma4Args, backend: Backend, ops, shape: BlockShape
    ) -> None:
        p = f"blk.{i}."
        self.kv_source = args.kv_sources[i]
        self.k_eq_v = not (f.has_tensor(p + "attn_v.weight") or f.has_tensor(p + "attn_qkv.weight"))
        if self.kv_source != i:  # q alone: its keys and values are another layer's
            shape = replace(shape, qk_norm=None)
        super().__init__(f, i, args.layer(i), backend, ops, shape)
        if self.kv_source != i:
            self.q_norm = ops.vector(f.tensor(p + "attn_q_norm.weight"))
        scale = p + "layer_output_scale.weight"
        self.out_scale = float(f.tensor(scale)[0]) if f.has_tensor(scale) else None
        self.per_layer_gate = self.per_layer_proj = self.per_layer_norm = None
        if args.per_layer_dim:
            self.per_layer_gate = backend.linear(f, [TensorPart(p + "inp_gate.weight")])  # [E, D]
            self.per_layer_proj = backend.linear(f, [TensorPart(p + "proj.weight")])  # [D, E]
            self.per_layer_norm = ops.vector(f.tensor(p + "post_norm.weight"))

    def _qkv_parts(self, f: GGUFFile, p: str) -> list[TensorPart]:
        parts = super()._qkv_parts(f, p)
        if self.kv_source != self.index:
            return parts[:1]  # q
        return parts[:2] if self.k_eq_v else parts  # q, k: v is k's projection

    def build_mlp(self, f: GGUFFile, p: str, backend: Backend) -> None:
        super().build_mlp(f, p, backend)  # the dense FFN, beside the experts where any
        self.moe = None
        if f.has_tensor(p + "ffn_gate_inp.weight"):
            if self.args.moe is None:
                raise ModelFormatError(f"{f.path.name}: {p}ffn_gate_inp without expert_count")
            self.moe = Gemma4Experts(f, p, self.args, backend, self.ops)
            norms = ("post_ffw_norm_1", "post_ffw_norm_2")
            self.post_mlp_norm, self.post_moe_norm = (
                self.ops.vector(f.tensor(p + n + ".weight")) for n in norms
            )

    def weights(self) -> list[Any]:
        extra = [w for w in (self.per_layer_gate, self.per_layer_proj) if w is not None]
        return super().weights() + extra + (self.moe.weights() if self.moe else [])

    def mlp(self, x, layout: BatchLayout):
        out = super().mlp(x, layout)  # [T, D]
        if self.moe is None:
            return out
        eps, ops = self.args.norm_eps, self.ops
        experts = self.moe(ops.rms_normalize(x, eps), layout)  # [T, D]
        return ops.rms_norm(out, self.post_mlp_norm, eps) + ops.rms_norm(
            experts, self.post_moe_norm, eps
        )

    def __call__(self, x, layout: BatchLayout, ropes: dict) -> Any:
        h = x + self._residual(self._attention(x, layout, ropes), True)
        out = h + self._residual(self.mlp(h, layout), False)  # [T, D]
        if self.per_layer_gate is not None:
            out = out + self._per_layer(out, ropes[PER_LAYER][:, self.index], layout)
        return out if self.out_scale is None else out * self.out_scale

    def _per_layer(self, x, inputs, layout: BatchLayout):
        """The per-layer input's product: gelu(gate(x)) * inputs `[T, E]`, projected back
        and normed."""
        gated = self.ops.gelu_tanh_mul(linear(x, self.per_layer_gate, layout), inputs)  # [T, E]
        out = linear(gated, self.per_layer_proj, layout)  # [T, E] -> [T, D]
        return self.ops.rms_norm(out, self.per_layer_norm, self.args.norm_eps)

    def _attention(self, x, layout: BatchLayout, ropes: dict):
        a, t, ops, rope = self.args, x.shape[0], self.ops, ropes[self.rope_key]
        # [T, D] -> [T, (H+2Hkv)*Dh]: (H+Hkv)*Dh where v is k's projection, H*Dh sharing
        qkv = self.project(x, self.wqkv, layout, self.attn_norm)
        q_end, k_end = a.n_heads * a.head_dim, (a.n_heads + a.n_kv_heads) * a.head_dim
        q = qkv[:, :q_end].reshape(t, a.n_heads, a.head_dim)
        q = ops.apply_rope(ops.rms_norm(q, self.q_norm, a.norm_eps), *rope)  # [T, H, Dh]
        if self.kv_source != self.index:  # stored again where the source stored them
            k, v = ropes[SHARED_KV][self.kv_source]
        else:
            k = qkv[:, q_end:k_end].reshape(t, a.n_kv_heads, a.head_dim)
            v = k if self.k_eq_v else qkv[:, k_end:].reshape(t, a.n_kv_heads, a.head_dim)
            v = ops.rms_normalize(v, a.norm_eps)  # [T, Hkv, Dh], no weight
            k = ops.apply_rope(ops.rms_norm(k, self.k_norm, a.norm_eps), *rope)
            ropes[SHARED_KV][self.index] = k, v
        out = ops.attend(self.index, q, k, v, layout, self.window, None)  # [T, H*Dh]
        return linear(out, self.wo, layout)  # [T, H*Dh] -> [T, D]


class Gemma4Experts(MoE):
    """A layer's experts (26B-A4B), called with the layer's input RMS-normalized: the
    experts read it times pre_ffw_norm_2 (folded into their products), the router over
    sqrt(dim) times ffn_gate_inp.scale; each expert's output times its ffn_down_exps.scale."""

    def __init__(self, f: GGUFFile, p: str, args: Gemma4Args, backend: Backend, ops) -> None:
        pre_norm = f.tensor(p + "pre_ffw_norm_2.weight")
        super().__init__(f, p, args.moe, backend, ops, pre_norm, "gelu_tanh_mul")
        self.inv_sqrt_dim = np.float32(1.0) / np.sqrt(np.float32(args.dim))
        self.router_scale = f.tensor(p + "ffn_gate_inp.scale")  # [D]
        scales = p + "ffn_down_exps.scale"
        self.down_scales = f.tensor(scales).tolist() if f.has_tensor(scales) else None

    def __call__(self, xn, layout: BatchLayout | None = None):
        if getattr(self.ops, "cuda", False) and _capturing():
            raise RuntimeError("a MoE layer chooses its experts on the host: not capturable")
        x_in = (self.ops.to_host(xn) * self.inv_sqrt_dim) * self.router_scale  # [T, D]
        logits = np.einsum("td,ed->te", x_in, self.router)  # [T, E]: each row's own dots
        chosen, weights = route(logits, self.args)  # [T, k] each
        return self._weighted_sum(self._expert_rows(xn, chosen), weights)

    def _expert(self, e: int, x):
        out = super()._expert(e, x)  # [n, D]
        return out if self.down_scales is None else out * self.down_scales[e]


class Gemma4Model(Decoder):
    # the pre-norms unfolded: a fold re-rounds fp16 weights, which q.k unscaled magnifies
    shape = BlockShape(norms="pre_post", qk_norm="head", activation="gelu_tanh", fold_norms=False)
    block = Gemma4Block

    def __init__(self, f: GGUFFile, backend: Backend) -> None:
        super().__init__(f, backend)
        self.per_layer_embed = self.per_layer_model_proj = self.per_layer_proj_norm = None
        if self.args.per_layer_dim:
            self.per_layer_embed = backend.embedding(f, "per_layer_token_embd.weight")
            # through the backend itself: not a LoRA target (runtime/lora.py maps adapters
            # onto the layers' and the head's weights)
            plain = getattr(backend, "backend", backend)
            parts = [TensorPart("per_layer_model_proj.weight")]
            self.per_layer_model_proj = plain.linear(f, parts)  # [L*E, D]
            self.per_layer_proj_norm = self.ops.vector(f.tensor("per_layer_proj_norm.weight"))

    @staticmethod
    def read_args(f: GGUFFile) -> Gemma4Args:
        return _read_args(f)

    @property
    def nbytes(self) -> int:
        extra = [w for w in (self.per_layer_embed, self.per_layer_model_proj) if w is not None]
        return super().nbytes + sum(w.nbytes for w in extra)

    @property
    def kv_layer_shapes(self) -> list[tuple[int, int]]:
        return list(zip(self.args.kv_heads, self.args.head_dims, strict=True))

    @property
    def kv_sources(self) -> list[int]:
        return list(self.args.kv_sources)

    def rope_freqs(self, f: GGUFFile) -> dict[Hashable, tuple]:
        a = self.args
        factors = f.tensor("rope_freqs.weight") if f.has_tensor("rope_freqs.weight") else None
        return {
            GLOBAL: (rope_inv_freq(a.n_rot, a.rope_base, factors), a.rope_scale),
            LOCAL: (rope_inv_freq(a.local_n_rot, a.local_rope_base), a.rope_scale),
        }

    def forward(self, tokens: np.ndarray, layout: BatchLayout):
        self.ops.prepare(layout, self.kv_windows)
        x = self.embed(tokens) * np.float32(self.args.embed_scale)  # [T] -> [T, D]
        positions = layout.positions()
        ropes: dict[Hashable, Any] = {
            key: self.ops.rope_tables(positions, *rope) for key, rope in self.ropes.items()
        }
        ropes[SHARED_KV] = {}
        if self.per_layer_embed is not None:
            ropes[PER_LAYER] = self.per_layer_inputs(tokens, x, layout)
        return self.run_layers(x, layout, ropes)

    def per_layer_inputs(self, tokens: np.ndarray, x, layout: BatchLayout):
        """Each layer's input `[T, L, E]`: the token's per_layer_token_embd row times
        sqrt(E), plus the embedding `x` `[T, D]` projected (over sqrt(D)) and RMS-normed per
        layer, the sum over sqrt(2) (llama.cpp's project_per_layer_inputs)."""
        a, t = self.args, x.shape[0]
        shape = (t, a.n_layers, a.per_layer_dim)
        rows = self.per_layer_embed(tokens).reshape(shape)  # [T, L*E] -> [T, L, E]
        rows = rows * np.float32(np.sqrt(np.float32(a.per_layer_dim)))
        proj = linear(x, self.per_layer_model_proj, layout)  # [T, D] -> [T, L*E]
        proj = proj * (np.float32(1.0) / np.sqrt(np.float32(a.dim)))
        proj = self.ops.rms_norm(proj.reshape(shape), self.per_layer_proj_norm, a.norm_eps)
        return (proj + rows) * (np.float32(1.0) / np.sqrt(np.float32(2.0)))
