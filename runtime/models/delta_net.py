"""The Gated DeltaNet layer (linear attention) as llama.cpp computes it (src/models/qwen35.cpp
`build_layer_attn_linear`, src/models/delta-net-base.cpp), on the host (numpy).

One fused product of the normed input gives the conv's input (q, k, v channels), the output
gate z, beta's and alpha's logits. Per sequence, in token order:

- a causal depthwise conv1d of `conv_kernel` taps over the q/k/v channels, then SiLU; the
  last `conv_kernel - 1` inputs are the sequence's conv state;
- q and k L2-normalized per head, q times 1/sqrt(head size); value head h reads key head
  h % key heads (the converter stores value heads tiled for ggml's broadcast);
- the gated delta rule on the state S `[Hv, Dv, Dk]`: S *= exp(g); S += beta (v - S k) k^T;
  out = S q, with g = softplus(alpha + dt_bias) * ssm_a (ssm_a = -exp(A_log)) and beta =
  sigmoid;
- RMSNorm of each head's output (ssm_norm) times SiLU(z), then ssm_out.

The recurrence runs token by token (llama.cpp's autoregressive form; its prefill uses a
chunked form of the same sums), so a sequence's numbers do not depend on how its prompt is
cut into chunks or what shares its batch. The state lives on the sequence's KV cache
(`PagedKVCache.recurrent`, one `DeltaNetState` per layer): it is what the sequence's tokens
so far left, and a cache that has tokens but not this state (a prefix cache's shared blocks)
is refused rather than computed from a zero state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.errors import LLMQRuntimeError
from runtime.gguf_file import GGUFFile
from runtime.kernels import Backend, TensorPart
from runtime.models.base import BatchLayout, linear, rms_norm, sigmoid


@dataclass(frozen=True)
class DeltaNetArgs:
    """GGUF's ssm.* keys as llama.cpp's qwen35 reads them."""

    conv_kernel: int  # ssm.conv_kernel
    head_dim: int  # ssm.state_size: key and value head size
    n_k_heads: int  # ssm.group_count
    n_v_heads: int  # ssm.time_step_rank
    norm_eps: float

    @classmethod
    def read(cls, f: GGUFFile, norm_eps: float) -> DeltaNetArgs:
        args = cls(
            conv_kernel=int(f.require("ssm.conv_kernel")),
            head_dim=int(f.require("ssm.state_size")),
            n_k_heads=int(f.require("ssm.group_count")),
            n_v_heads=int(f.require("ssm.time_step_rank")),
            norm_eps=norm_eps,
        )
        inner = int(f.require("ssm.inner_size"))
        if inner != args.n_v_heads * args.head_dim or args.n_v_heads % args.n_k_heads:
            raise ValueError(
                f"{f.path.name}: ssm.inner_size {inner} must be ssm.time_step_rank "
                f"{args.n_v_heads} x ssm.state_size {args.head_dim}, a multiple of "
                f"ssm.group_count {args.n_k_heads} value heads"
            )
        return args

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass
class DeltaNetState:
    """One sequence's state in one layer: the conv's last inputs and the delta rule's S."""

    conv: np.ndarray  # [K-1, C]
    ssm: np.ndarray  # [Hv, Dv, Dk]

    @classmethod
    def zeros(cls, a: DeltaNetArgs) -> DeltaNetState:
        return cls(
            np.zeros((a.conv_kernel - 1, a.conv_dim), np.float32),
            np.zeros((a.n_v_heads, a.head_dim, a.head_dim), np.float32),
        )

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


class RecurrentStateError(LLMQRuntimeError):
    """A sequence's cache holds tokens whose recurrent state it does not have."""


def softplus(x: np.ndarray) -> np.ndarray:
    """ggml_softplus: x above 20, else log(1 + e^x)."""
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0)))).astype(np.float32)


def l2_normalize(x: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(sum(x^2) + eps) over the last axis (llama.cpp's build_gdn_l2_norm)."""
    sum_sq = np.einsum("...d,...d->...", x, x)[..., None]  # [..., 1]
    return x * (1.0 / np.sqrt(sum_sq + np.float32(eps))).astype(np.float32)


def causal_conv(x: np.ndarray, state: DeltaNetState, weight: np.ndarray) -> np.ndarray:
    """Depthwise causal conv of `x` `[L, C]` after the state's inputs, `weight` `[C, K]`
    (ggml_ssm_conv); the state keeps the last K-1 inputs. Taps summed in order per row."""
    taps = weight.shape[1]
    padded = np.concatenate([state.conv, x])  # [K-1+L, C]
    out = padded[: len(x)] * weight[:, 0]
    for k in range(1, taps):
        out += padded[k : k + len(x)] * weight[:, k]  # [L, C]
    state.conv = padded[len(padded) - (taps - 1) :].copy()
    return out


def delta_rule(q, k, v, g, beta, state: DeltaNetState) -> np.ndarray:
    """The gated delta rule over one sequence's tokens: q, k `[L, Hv, Dk]` (heads repeated
    to the value heads), v `[L, Hv, Dv]`, g and beta `[L, Hv]` -> out `[L, Hv, Dv]`."""
    s, out = state.ssm, np.empty_like(v)
    decay = np.exp(g)  # [L, Hv]
    for t in range(len(q)):
        s *= decay[t][:, None, None]
        delta = (v[t] - np.einsum("hij,hj->hi", s, k[t])) * beta[t][:, None]  # [Hv, Dv]
        s += delta[:, :, None] * k[t][:, None, :]  # [Hv, Dv, Dk]
        out[t] = np.einsum("hij,hj->hi", s, q[t])
    return out


class GatedDeltaNet:
    """A Gated DeltaNet layer's weights and its forward pass over a batch's sequences."""

    def __init__(
        self, f: GGUFFile, p: str, args: DeltaNetArgs, backend: Backend, norm=None
    ) -> None:
        """`norm`: the layer's pre-norm weight where it is folded into the input product."""
        self.args, self.index = args, int(p.split(".")[1])
        names = ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight")
        self.w_in = backend.linear(f, [TensorPart(p + n) for n in names], norm)  # [C+Vd+2Hv, D]
        self.w_out = backend.linear(f, [TensorPart(p + "ssm_out.weight")])  # [D, Vd]
        self.conv_weight = f.tensor(p + "ssm_conv1d.weight")  # [C, K]
        self.dt_bias = f.tensor(p + "ssm_dt.bias")  # [Hv]
        self.a = f.tensor(p + "ssm_a")  # [Hv]: -exp(A_log)
        self.out_norm = f.tensor(p + "ssm_norm.weight")  # [Dv]

    def weights(self) -> list[Any]:
        return [self.w_in, self.w_out]

    def __call__(self, projected: np.ndarray, layout: BatchLayout) -> np.ndarray:
        """`projected` `[T, C+Vd+2Hv]` (the normed input through `w_in`) -> `[T, D]`."""
        a = self.args
        c, vd, hv = a.conv_dim, a.value_dim, a.n_v_heads
        z = projected[:, c : c + vd].reshape(-1, hv, a.head_dim)  # [T, Hv, Dv]
        beta = sigmoid(projected[:, c + vd : c + vd + hv])  # [T, Hv]
        g = softplus(projected[:, c + vd + hv :] + self.dt_bias) * self.a  # [T, Hv]
        out = np.empty_like(z)
        for start, end, chunk in layout.spans:
            state = self._state(chunk)
            mixed = causal_conv(projected[start:end, :c], state, self.conv_weight)  # [L, C]
            out[start:end] = self._recur(mixed, g[start:end], beta[start:end], state)
        gate = z / (1.0 + np.exp(-z))  # silu(z)
        out = rms_norm(out, self.out_norm, a.norm_eps) * gate  # [T, Hv, Dv]
        return linear(out.reshape(len(out), vd), self.w_out, layout)  # [T, Vd] -> [T, D]

    def _recur(self, mixed, g, beta, state: DeltaNetState) -> np.ndarray:
        a, n = self.args, len(mixed)
        mixed = mixed / (1.0 + np.exp(-mixed))  # silu
        q = mixed[:, : a.key_dim].reshape(n, a.n_k_heads, a.head_dim)
        k = mixed[:, a.key_dim : 2 * a.key_dim].reshape(n, a.n_k_heads, a.head_dim)
        v = mixed[:, 2 * a.key_dim :].reshape(n, a.n_v_heads, a.head_dim)  # [L, Hv, Dv]
        q = l2_normalize(q, a.norm_eps) * np.float32(1.0 / np.sqrt(a.head_dim))
        k = l2_normalize(k, a.norm_eps)
        repeat = a.n_v_heads // a.n_k_heads  # value head h reads key head h % Hk
        q, k = np.tile(q, (1, repeat, 1)), np.tile(k, (1, repeat, 1))  # [L, Hv, Dk]
        return delta_rule(q, k, v, g, beta, state)

    def _state(self, chunk) -> DeltaNetState:
        """The sequence's state in this layer: fresh at its first token, else what its
        earlier tokens left (refused where the cache has tokens but no state)."""
        states = chunk.cache.recurrent
        if chunk.start == 0:
            states[self.index] = DeltaNetState.zeros(self.args)
        elif self.index not in states:
            raise RecurrentStateError(
                f"layer {self.index}'s recurrent state for positions 0..{chunk.start - 1} "
                "is not in this cache (a hybrid model runs without the prefix cache)"
            )
        return states[self.index]
