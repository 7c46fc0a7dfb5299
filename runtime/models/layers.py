"""The named pieces an architecture file composes: its args read from GGUF, the layer's
shape (where the norms sit, q/k norms, q/k/v bias, the gated activation) and the decoder
around the layers (embedding and logit scales, one rope table set per kind of layer).

Each variant is the one llama.cpp builds in src/models/<arch>.cpp on the tensors its
convert_hf_to_gguf.py wrote; an architecture file picks them and says which layer gets
which window and rope, the way mlx-lm's models/ compose theirs.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.gguf_file import GGUFFile
from runtime.kernels import Backend, TensorPart
from runtime.models.base import (
    BatchLayout,
    DecoderModel,
    gated_mlp,
    linear,
    normed_linear,
    rope_inv_freq,
)
from runtime.models.ops import array_ops

GLOBAL = "global"  # the rope key of a layer with the model's main rope
Q_TEMPERATURE = "q temperature"  # beside the rope tables: each row's q multiplier


@dataclass
class Yarn:
    """YaRN rope scaling as llama.cpp applies it (ggml's rope_yarn with the attention
    factor src/llama-context.cpp sets): per frequency a mix of interpolated (divided by
    `factor`) and original, ramped between the correction dims, cos and sin times mscale."""

    factor: float
    original_context: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    ext_factor: float = 1.0
    log_mul: float = 0.0  # rope.scaling.yarn_log_multiplier (mscale_all_dim)
    attn_factor: float = 1.0  # rope.scaling.yarn_attn_factor: used only without the ramp
    # the correction dims rounded out to whole pairs, as ggml does; OpenAI's gpt-oss and
    # transformers' `truncate: false` keep them fractional (no GGUF key says which)
    truncate: bool = True

    @classmethod
    def read(cls, f: GGUFFile) -> Yarn:
        return cls(
            factor=float(f.require("rope.scaling.factor")),
            original_context=int(f.require("rope.scaling.original_context_length")),
            beta_fast=float(f.arch_value("rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(f.arch_value("rope.scaling.yarn_beta_slow", 1.0)),
            ext_factor=float(f.arch_value("rope.scaling.yarn_ext_factor", 1.0)),
            log_mul=float(f.arch_value("rope.scaling.yarn_log_multiplier", 0.0)),
            attn_factor=float(f.arch_value("rope.scaling.yarn_attn_factor", 1.0)),
        )

    def corr_dims(self, n_rot: int, base: float) -> tuple[float, float]:
        """ggml_rope_yarn_corr_dims: the frequency pairs where the ramp starts and ends
        (rounded down and up unless `truncate` is off)."""

        def dim(n_turns: float) -> float:
            return (
                n_rot * np.log(self.original_context / (n_turns * 2 * np.pi)) / (2 * np.log(base))
            )

        low, high = dim(self.beta_fast), dim(self.beta_slow)
        if self.truncate:
            low, high = np.floor(low), np.ceil(high)
        return max(0.0, float(low)), min(n_rot - 1.0, float(high))

    def apply(self, inv_freq: np.ndarray, n_rot: int, base: float) -> tuple[np.ndarray, float]:
        """(the scaled inverse frequencies, cos/sin multiplier)."""
        if self.ext_factor == 0.0:
            return inv_freq / self.factor, self.attn_factor
        low, high = self.corr_dims(n_rot, base)
        y = (np.arange(len(inv_freq)) - low) / max(0.001, high - low)
        ramp = (1 - np.clip(y, 0.0, 1.0)) * self.ext_factor
        scaled = inv_freq * ((1 - ramp) / self.factor + ramp)

        def mscale(m: float) -> float:
            return 1.0 if self.factor <= 1.0 else 0.1 * m * float(np.log(self.factor)) + 1.0

        return scaled, mscale(1.0) / mscale(self.log_mul) if self.log_mul else mscale(1.0)


@dataclass
class DecoderArgs:
    """Hyperparameters every decoder reads alike from GGUF; an architecture subclasses it
    for its own keys and for which layer gets which window and rope (`window`, `rope`)."""

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
    # q's scale before q.k (None: 1/sqrt(head_dim)); granite's multipliers
    attn_scale: float | None = None
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0  # logits are multiplied by this
    final_softcap: float | None = None  # gemma2: cap * tanh(logits / cap)
    yarn: Yarn | None = None  # YaRN rope scaling (then rope_scale is 1)
    rope_attn_factor: float = 1.0  # rope.scaling.attn_factor: cos and sin times this
    # Llama 4's attention temperature (Ministral 3): q times 1 + t * log(floor(p / n) + 1)
    q_temperature: float = 0.0
    q_temperature_floor: int = 1
    attn_softcap: float | None = None  # gemma2: the same on every attention score
    # a sliding window (0: none) over the layers marked in `sliding` (sliding_layers)
    sliding_window: int = 0
    sliding: tuple[bool, ...] = ()

    @classmethod
    def read(cls, f: GGUFFile, norm_eps: float = 1e-5, rope_base: float = 10000.0, **extra):
        dim, n_heads = int(f.require("embedding_length")), int(f.require("attention.head_count"))
        head_dim = int(f.arch_value("attention.key_length", dim // n_heads))
        yarn = f.arch_value("rope.scaling.type") == "yarn"
        return cls(
            n_layers=int(f.require("block_count")),
            dim=dim,
            n_heads=n_heads,
            # a list per layer (Gemma 4's full layers have their own): the most, the pool's
            n_kv_heads=int(np.max(f.arch_value("attention.head_count_kv", n_heads))),
            head_dim=head_dim,
            ffn_dim=int(np.max(f.require("feed_forward_length"))),  # Gemma 4's: per layer
            norm_eps=float(f.arch_value("attention.layer_norm_rms_epsilon", norm_eps)),
            rope_base=float(f.arch_value("rope.freq_base", rope_base)),
            rope_scale=1.0 if yarn else f.linear_rope_scale(),
            yarn=Yarn.read(f) if yarn else None,
            rope_attn_factor=float(f.arch_value("rope.scaling.attn_factor", 1.0)),
            n_rot=int(f.arch_value("rope.dimension_count", head_dim)),
            context_length=int(f.require("context_length")),
            vocab_size=len(f.metadata["tokenizer.ggml.tokens"]),
            **extra,
        )

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding attention window (None: the whole context)."""
        if self.sliding_window > 0 and self.sliding[layer]:
            return self.sliding_window
        return None

    def rope(self, layer: int) -> Hashable | None:
        """Which of the model's rope tables layer `layer` rotates with (None: no rope)."""
        return GLOBAL


def sliding_layers(f: GGUFFile, n_layers: int, pattern: int) -> tuple[bool, ...]:
    """Which layers slide, as llama.cpp's `load_swa_pattern` reads them: the file's
    `attention.sliding_window_pattern` as one flag per layer, or as a period n (layer i
    slides when i % n < n - 1; n = 0: all do), else the architecture's own period."""
    value = f.arch_value("attention.sliding_window_pattern", pattern)
    if isinstance(value, list | tuple):
        return tuple(bool(v) for v in value)
    n = int(value)
    return tuple(n == 0 or i % n < n - 1 for i in range(n_layers))


@dataclass(frozen=True)
class BlockShape:
    """How a layer is put together. Fused attn_qkv / ffn_up tensors (phi3) are found from
    the file, not declared."""

    norms: str = "pre"  # "pre" | "pre_post" (gemma2/3: both) | "post" (olmo2: after only)
    qk_norm: str | None = None  # "head": per head (qwen3, gemma3); "full": whole q and k (olmo2)
    qkv_bias: bool = False  # qwen2
    permuted_qk: bool = False  # converter interleaved q/k rows for llama.cpp's NORM rope
    activation: str = "silu"  # or "gelu_tanh"
    # False: the pre-norms' weights multiply the activations instead of being folded into
    # the products' columns, where a fold re-rounds fp16 weights (Gemma 4, whose unscaled
    # q.k magnifies that: 2.1e-3 of its largest logit from float32, unfolded 2e-6)
    fold_norms: bool = True


def unpermute_order(out_dim: int, n_heads: int) -> np.ndarray:
    """Row order undoing the GGUF converter's q/k interleave: rows (2i, 2i+1) -> (i, i + half)
    within each head. A row order applies to float rows and to quantized rows alike."""
    half = out_dim // n_heads // 2
    return np.arange(out_dim).reshape(n_heads, half, 2).swapaxes(1, 2).reshape(out_dim)


def _q_scaled(values: np.ndarray, scale: float | None, head_dim: int) -> np.ndarray:
    """`values` (q's norm weight) times q's attention scale."""
    return values / np.sqrt(head_dim) if scale is None else values * np.float32(scale)


class Block:
    """One decoder layer: attention then a gated MLP, each with its residual. The pre-norms
    are folded into the products after them (normed_linear); the 1/sqrt(Dh) scale into q's
    rows, or into q's norm where it has one."""

    def __init__(
        self, f: GGUFFile, i: int, args: DecoderArgs, backend: Backend, ops, shape: BlockShape
    ) -> None:
        p = f"blk.{i}."
        self.index, self.args, self.ops, self.shape = i, args, ops, shape
        self.window, self.rope_key = args.window(i), args.rope(i)
        self.pre_norm = shape.norms != "post"
        post = shape.norms != "pre"
        self.post_attn_norm = self._vector(f, p + "post_attention_norm.weight", post)
        self.post_ffn_norm = self._vector(f, p + "post_ffw_norm.weight", post)
        self.q_norm = self.k_norm = self.bias = None
        self.q_scale = 1.0  # q's scale where it is not in q's rows or norm
        if shape.qk_norm is not None:
            q_norm = f.tensor(p + "attn_q_norm.weight")
            self.q_norm = ops.vector(_q_scaled(q_norm, args.attn_scale, args.head_dim))
            self.k_norm = ops.vector(f.tensor(p + "attn_k_norm.weight"))
        attn_norm, self.attn_norm = self._pre_norm(f, p + "attn_norm.weight")
        self.wqkv = backend.linear(f, self._qkv_parts(f, p), attn_norm)  # [(H+2Hkv)*Dh, D]
        if shape.qkv_bias:
            self.bias = ops.vector(self._qkv_bias(f, p))
        self.wo = backend.linear(f, [TensorPart(p + "attn_output.weight")])  # [D, H*Dh]
        # gpt-oss: attn_output's bias, and a sink logit per head in attention's softmax
        self.out_bias, self.sinks = (
            self._vector(f, p + name, f.has_tensor(p + name))
            for name in ("attn_output.bias", "attn_sinks.weight")
        )
        self.activation_mul = getattr(ops, shape.activation + "_mul")
        self.build_mlp(f, p, backend)

    def build_mlp(self, f: GGUFFile, p: str, backend: Backend) -> None:
        """The feed-forward weights (a MoE block, runtime/models/moe.py, builds its own)."""
        fused = not f.has_tensor(p + "ffn_gate.weight")  # phi3: ffn_up holds gate then up
        names = ("up",) if fused else ("gate", "up")
        gate_up = [TensorPart(p + f"ffn_{n}.weight") for n in names]
        ffn_norm, self.ffn_norm = self._pre_norm(f, p + "ffn_norm.weight")
        self.w_gate_up = backend.linear(f, gate_up, ffn_norm)  # [2F, D]
        self.w_down = backend.linear(f, [TensorPart(p + "ffn_down.weight")])  # [D, F]

    def weights(self) -> list[Any]:
        """The layer's linear weights (what `weight_kinds` and `nbytes` count)."""
        return [self.wqkv, self.wo, self.w_gate_up, self.w_down]

    def _pre_norm(self, f: GGUFFile, name: str) -> tuple[np.ndarray | None, Any]:
        """A pre-norm's weight as (folded into the product after it, or kept beside it)."""
        if not self.pre_norm:
            return None, None
        if self.shape.fold_norms:
            return f.tensor(name), None
        return None, self.ops.vector(f.tensor(name))

    def _vector(self, f: GGUFFile, name: str, wanted: bool) -> Any:
        return self.ops.vector(f.tensor(name)) if wanted else None

    def _orders(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        a = self.args
        if not self.shape.permuted_qk:
            return None, None
        q_rows, kv_rows = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        return unpermute_order(q_rows, a.n_heads), unpermute_order(kv_rows, a.n_kv_heads)

    def _q_rows_scale(self) -> float:
        a = self.args
        if self.shape.qk_norm is not None:
            return 1.0  # in q's norm instead
        return 1 / float(np.sqrt(a.head_dim)) if a.attn_scale is None else a.attn_scale

    def _qkv_parts(self, f: GGUFFile, p: str) -> list[TensorPart]:
        if f.has_tensor(p + "attn_qkv.weight"):  # fused (phi3): q, k, v rows in order
            if self.shape.permuted_qk:
                raise ValueError("a fused attn_qkv cannot have its q/k rows reordered")
            # one tensor takes one scale, so q's is applied as the layer runs
            self.q_scale = self._q_rows_scale()
            return [TensorPart(p + "attn_qkv.weight")]
        q_order, k_order = self._orders()
        return [
            TensorPart(p + "attn_q.weight", q_order, self._q_rows_scale()),
            TensorPart(p + "attn_k.weight", k_order),
            TensorPart(p + "attn_v.weight"),
        ]

    def _qkv_bias(self, f: GGUFFile, p: str) -> np.ndarray:
        q_order, k_order = self._orders()
        q, k, v = (f.tensor(p + f"attn_{n}.bias") for n in "qkv")
        q = q if q_order is None else q[q_order]
        if self.q_scale == 1.0:  # in q's rows, so in q's bias too
            q = q * np.float32(self._q_rows_scale())
        k = k if k_order is None else k[k_order]
        return np.concatenate([q, k, v]).astype(np.float32)

    def __call__(self, x, layout: BatchLayout, ropes: dict) -> Any:
        rope, q_temperature = ropes.get(self.rope_key), ropes.get(Q_TEMPERATURE)
        attn = self._residual(self.attention(x, layout, rope, q_temperature), True)
        h = x + attn
        return h + self._residual(self.mlp(h, layout), False)

    def _residual(self, out, attention: bool) -> Any:
        """A sublayer's output as the residual adds it: post-normed, scaled (granite)."""
        norm = self.post_attn_norm if attention else self.post_ffn_norm
        if norm is not None:
            out = self.ops.rms_norm(out, norm, self.args.norm_eps)
        if self.args.residual_scale != 1.0:
            out = out * self.args.residual_scale
        return out

    def project(self, x, weight, layout: BatchLayout, norm=None):
        """`x`'s product with `weight`, through the pre-norm when the layer has one (its
        weight `norm` where it is not folded into `weight`)."""
        if norm is not None:
            return linear(self.ops.rms_norm(x, norm, self.args.norm_eps), weight, layout)
        if not self.pre_norm:
            return linear(x, weight, layout)
        return normed_linear(x, self.args.norm_eps, weight, layout, self.ops.rms_normalize)

    def attention(self, x, layout: BatchLayout, rope: tuple | None, q_temperature=None):
        a, t, ops = self.args, x.shape[0], self.ops
        q_end, k_end = a.n_heads * a.head_dim, (a.n_heads + a.n_kv_heads) * a.head_dim
        qkv = self.project(x, self.wqkv, layout, self.attn_norm)  # [T, D] -> [T, (H+2Hkv)*Dh]
        if self.bias is not None:
            qkv = qkv + self.bias
        v = qkv[:, k_end:].reshape(t, a.n_kv_heads, a.head_dim)
        if self.q_norm is None and rope is not None and self.q_scale == 1.0:  # q, k as one
            qk = ops.apply_rope(qkv[:, :k_end].reshape(t, a.n_heads + a.n_kv_heads, -1), *rope)
            q, k = qk[:, : a.n_heads], qk[:, a.n_heads :]  # [T, H, Dh], [T, Hkv, Dh]
        else:
            q, k = self._normed_qk(qkv[:, :q_end], qkv[:, q_end:k_end])
            q, k = (ops.apply_rope(y, *rope) if rope else ops.no_rope(y) for y in (q, k))
        if q_temperature is not None:
            q = q * q_temperature  # [T, H, Dh] * [T, 1, 1]
        out = ops.attend(self.index, q, k, v, layout, self.window, a.attn_softcap, self.sinks)
        out = linear(out, self.wo, layout)  # [T, H*Dh] -> [T, D]
        return out if self.out_bias is None else out + self.out_bias

    def _normed_qk(self, q, k):
        """q `[T, H*Dh]`, k `[T, Hkv*Dh]` -> per head, through their norms if any."""
        a, t, ops, eps = self.args, q.shape[0], self.ops, self.args.norm_eps
        if self.q_scale != 1.0:
            q = q * self.q_scale
        if self.shape.qk_norm == "full":  # olmo2: over the whole projection
            q, k = ops.rms_norm(q, self.q_norm, eps), ops.rms_norm(k, self.k_norm, eps)
        q = q.reshape(t, a.n_heads, a.head_dim)
        k = k.reshape(t, a.n_kv_heads, a.head_dim)
        if self.shape.qk_norm == "head":
            q, k = ops.rms_norm(q, self.q_norm, eps), ops.rms_norm(k, self.k_norm, eps)
        return q, k

    def mlp(self, x, layout: BatchLayout):
        gate_up = self.project(x, self.w_gate_up, layout, self.ffn_norm)  # [T, D] -> [T, 2F]
        return gated_mlp(gate_up, self.w_down, self.activation_mul, layout)


class Decoder(DecoderModel):
    """A decoder of `Block`s: embedding (times `embed_scale`), the layers, the final norm
    and the head (tied to the embedding when the file has no output.weight). Architecture
    files set `shape` and `read_args`, and `rope_freqs` where their rope differs."""

    shape = BlockShape()
    block: type[Block] = Block  # the layer class (runtime/models/moe.py: `MoEBlock`)

    @staticmethod
    def read_args(f: GGUFFile) -> DecoderArgs:
        return DecoderArgs.read(f)

    def __init__(self, f: GGUFFile, backend: Backend) -> None:
        self.args = a = self.read_args(f)
        self.ops = ops = array_ops(backend)
        self.embed = backend.embedding(f, "token_embd.weight")  # [V, D]
        if f.has_tensor("output.weight"):
            self.output = backend.head(f, "output.weight")
        else:
            self.output = backend.head(f, "token_embd.weight", tied=self.embed)
        self.norm = ops.vector(f.tensor("output_norm.weight"))
        self.ropes = self.rope_freqs(f)
        self.layers = [self.block(f, i, a, backend, ops, self.shape) for i in range(a.n_layers)]

    def rope_freqs(self, f: GGUFFile) -> dict[Hashable, tuple]:
        """Each rope key's arguments to `rope_tables` after the positions: (inverse
        frequencies, linear scale[, cos/sin multiplier]); llama 3's `rope_freqs` tensor
        divides the frequencies."""
        factors = f.tensor("rope_freqs.weight") if f.has_tensor("rope_freqs.weight") else None
        return {GLOBAL: self.rope(factors)}

    def rope(self, factors: np.ndarray | None = None) -> tuple:
        """The main rope's `rope_tables` arguments: frequencies (divided by `factors`, then
        YaRN's), linear scale, cos/sin multiplier (rope.scaling.attn_factor, YaRN's)."""
        a = self.args
        inv_freq, mscale = rope_inv_freq(a.n_rot, a.rope_base, factors), a.rope_attn_factor
        if a.yarn is not None:
            inv_freq, yarn_mscale = a.yarn.apply(inv_freq, a.n_rot, a.rope_base)
            mscale *= yarn_mscale
        if mscale == 1.0:
            return inv_freq, a.rope_scale
        return inv_freq, a.rope_scale, mscale

    def forward(self, tokens: np.ndarray, layout: BatchLayout):
        self.ops.prepare(layout, self.kv_windows)
        x = self.embed(tokens)  # [T] -> [T, D]
        if self.args.embed_scale != 1.0:
            x = x * np.float32(self.args.embed_scale)
        positions = layout.positions()
        ropes = {key: self.ops.rope_tables(positions, *rope) for key, rope in self.ropes.items()}
        if self.args.q_temperature:
            a = self.args
            scale = self.ops.position_scale(positions, a.q_temperature, a.q_temperature_floor)
            ropes[Q_TEMPERATURE] = scale
        return self.run_layers(x, layout, ropes)

    def logits(self, hidden, exact=None):
        out = super().logits(hidden, exact)  # [N, D] -> [N, V]
        if self.args.logit_scale != 1.0:
            out = out * self.args.logit_scale
        if self.args.final_softcap is not None:
            out = self.ops.softcap(out, self.args.final_softcap)
        return out
