"""Mixture-of-experts feed-forward, as llama.cpp's `build_moe_ffn` (src/llama-graph.cpp)
computes it, for the architecture files that have one (qwen3moe.py, gpt_oss.py).

Use it as a layer: an architecture whose every FFN is a MoE sets `block = MoEBlock` on its
`Decoder` and returns `MoEDecoderArgs` from `read_args`, with `moe=MoEArgs.read(f, ...)`
naming what llama.cpp hard-codes for it:

    class Qwen3MoeModel(Decoder):
        block = MoEBlock
        def read_args(f):
            return MoEDecoderArgs.read(f, moe=MoEArgs.read(f, gating="softmax", norm_weights=True))

or as a piece of a block of one's own:

    moe = MoE(f, "blk.3.", args.moe, backend, ops, input_scale=ffn_norm, activation=act)
    out = moe(rms_normalize(h))  # [T, D] (normalized, its norm weight in input_scale) -> [T, D]

`gating` (GGUF `{arch}.expert_gating_func`, where a file gives it): "softmax" over the
router's logits, then the top k, their probabilities as weights (qwen3moe); "sigmoid"
likewise; "softmax_weight": the top k of the logits, a softmax over those k (gpt-oss).
`norm_weights`: the k weights divided by their sum (`expert_weights_norm`); `weights_scale`
(`expert_weights_scale`) multiplies them. `activation`: the name of an ops function
(`silu_mul`, `gelu_tanh_mul`, models/ops.py) or a callable `act(gate, up) -> hidden` taking
the arrays the ops use (numpy on the host, torch on the tensor path). Biases on the router
(`ffn_gate_inp.bias`) and on each expert (`ffn_{gate,up,down}_exps.bias`, `[E, rows]`) and
shared experts (`ffn_{gate,up,down}_shexp`, gated by `ffn_gate_inp_shexp` where present) are
read from the file when it has them.

Experts stay in their file type: each 3-D tensor `ffn_*_exps` `[E, out, in]` is E weights
of the backend's own kernels (runtime/gguf_file.py `expert_tensor`). A forward pass groups
its rows by expert and multiplies each chosen expert once over its rows (llama.cpp's
mul_mat_id); every step of a row's arithmetic (the router's float32 dots, its top k, the
products' rows, the weighted sum in slot order) is the row's own, so its result does not
depend on which rows share its step. The router and the top k run on the host (numpy) on
both paths; the tensor path's expert products and sums stay on its device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.errors import ModelFormatError
from runtime.gguf_file import GGUFFile, expert_tensor
from runtime.kernels import Backend, TensorPart
from runtime.models.base import BatchLayout, gated_mlp, linear, sigmoid
from runtime.models.layers import Block, DecoderArgs

# llama.cpp's llama_expert_gating_func_type values (src/llama-hparams.h)
GATING_FUNCS = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}
MIN_WEIGHT_SUM = 6.103515625e-5  # llama.cpp clamps the k weights' sum to the least fp16 normal


@dataclass(frozen=True)
class MoEArgs:
    n_experts: int
    n_used: int  # k: experts per token
    gating: str = "softmax"  # "softmax" | "sigmoid" | "softmax_weight" (after the top k)
    norm_weights: bool = False  # the k weights divided by their sum
    weights_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.gating not in GATING_FUNCS.values():
            raise ValueError(
                f"gating must be one of {sorted(GATING_FUNCS.values())}, got {self.gating!r}"
            )
        if not 0 < self.n_used <= self.n_experts:
            raise ValueError(
                f"n_used must be in (0, n_experts={self.n_experts}], got {self.n_used}"
            )

    @classmethod
    def read(cls, f: GGUFFile, **fixed: Any) -> MoEArgs:
        """From the file's `{arch}.expert_*` keys; `fixed` (gating, norm_weights,
        weights_scale) overrides them where llama.cpp hard-codes a value for the arch."""
        func = f.arch_value("expert_gating_func")
        if func is not None and int(func) not in GATING_FUNCS and "gating" not in fixed:
            raise ModelFormatError(f"{f.path.name}: expert gating function {func} is not supported")
        scale = float(f.arch_value("expert_weights_scale", 0.0) or 1.0)  # 0: none
        values: dict[str, Any] = {
            "gating": GATING_FUNCS.get(int(func or 1), "softmax"),
            "norm_weights": bool(f.arch_value("expert_weights_norm", False)),
            "weights_scale": scale,
        }
        values.update(fixed)
        return cls(int(f.require("expert_count")), int(f.require("expert_used_count")), **values)


@dataclass
class MoEDecoderArgs(DecoderArgs):
    """A decoder's args with its MoE's (every layer's FFN a MoE: `MoEBlock`)."""

    moe: MoEArgs = field(default_factory=lambda: MoEArgs(1, 1))


def softmax_rows(x: np.ndarray) -> np.ndarray:
    """ggml's soft_max on float32 rows: exp(x - max), summed in float64, times 1/sum."""
    p = np.exp(x - x.max(axis=-1, keepdims=True))
    return p * (1.0 / p.sum(axis=-1, dtype=np.float64, keepdims=True)).astype(np.float32)


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """`[T, E]` -> `[T, k]` indices of each row's k largest, largest first, as
    ggml_argsort_top_k orders them (ties: lower index first; ggml's std::sort leaves them
    unspecified past 16 experts)."""
    return np.argsort(-scores, axis=-1, kind="stable")[:, :k]


def route(logits: np.ndarray, args: MoEArgs, selection_bias: np.ndarray | None = None):
    """Router logits `[T, E]` -> (chosen experts `[T, k]`, their weights `[T, k]` float32)."""
    if args.gating == "softmax":
        probs = softmax_rows(logits)
    elif args.gating == "sigmoid":
        probs = sigmoid(logits).astype(np.float32)
    else:
        probs = logits
    scores = probs if selection_bias is None else probs + selection_bias
    chosen = top_k(scores, args.n_used)
    weights = np.take_along_axis(probs, chosen, axis=1)  # [T, k]
    if args.gating == "softmax_weight":
        weights = softmax_rows(weights)
    if args.norm_weights:
        total = np.maximum(weights.sum(axis=1, keepdims=True), np.float32(MIN_WEIGHT_SUM))
        weights = weights / total
    if args.weights_scale != 1.0:
        weights = weights * np.float32(args.weights_scale)
    return chosen, weights.astype(np.float32)


def _optional(f: GGUFFile, name: str) -> np.ndarray | None:
    return f.tensor(name) if f.has_tensor(name) else None


class MoE:
    """One layer's router, experts and shared experts. `input_scale` `[D]`: the FFN's norm
    weight, which the router's input is multiplied by and the experts' products fold in;
    called with the normalized rows."""

    def __init__(
        self,
        f: GGUFFile,
        prefix: str,
        args: MoEArgs,
        backend: Backend,
        ops: Any,
        input_scale: np.ndarray | None = None,
        activation: str | Callable = "silu_mul",
    ) -> None:
        p, self.args, self.ops = prefix, args, ops
        self.host = getattr(ops, "device", None) is None
        self.input_scale = input_scale
        self.router = f.tensor(p + "ffn_gate_inp.weight")  # [E, D] float32, as llama.cpp's
        if self.router.shape[0] != args.n_experts:
            raise ModelFormatError(
                f"{f.path.name}: {p}ffn_gate_inp.weight has {self.router.shape[0]} experts, "
                f"expert_count says {args.n_experts}"
            )
        self.router_bias = _optional(f, p + "ffn_gate_inp.bias")
        self.selection_bias = _optional(f, p + "exp_probs_b.bias")
        self.act = getattr(ops, activation) if isinstance(activation, str) else activation
        self.gate_up, self.down = self._experts(f, p, backend, input_scale)
        self.gate_up_bias, self.down_bias = self._expert_biases(f, p)
        self.shared = self._shared(f, p, backend, input_scale)

    def _experts(self, f: GGUFFile, p: str, backend: Backend, input_scale) -> tuple[list, list]:
        """Per expert: gate and up fused `[2F, D]` (or up alone), down `[D, F]`. Built by
        the backend itself, not the recorder a model loads through (runtime/lora.py
        `LinearSources`): experts take no LoRA, so no adapter maps onto them and no LoRA
        slot (runtime/lora_slots.py) is kept for each of their thousands of weights."""
        backend = getattr(backend, "backend", backend)
        merged = f.has_tensor(p + "ffn_gate_up_exps.weight")
        names = ["gate_up"] if merged else ["gate", "up"]
        names = [n for n in names if f.has_tensor(p + f"ffn_{n}_exps.weight")]
        self.gated = names != ["up"]
        gate_up, down = [], []
        for e in range(self.args.n_experts):
            parts = [TensorPart(expert_tensor(p + f"ffn_{n}_exps.weight", e)) for n in names]
            gate_up.append(backend.linear(f, parts, input_scale))
            down.append(
                backend.linear(f, [TensorPart(expert_tensor(p + "ffn_down_exps.weight", e))])
            )
        return gate_up, down

    def _expert_biases(self, f: GGUFFile, p: str) -> tuple[list | None, list | None]:
        up = _optional(f, p + "ffn_up_exps.bias")
        if up is None:
            return None, _vectors(self.ops, _optional(f, p + "ffn_down_exps.bias"))
        gate = _optional(f, p + "ffn_gate_exps.bias")
        gate_up = up if gate is None else np.concatenate([gate, up], axis=1)  # [E, 2F]
        return _vectors(self.ops, gate_up), _vectors(
            self.ops, _optional(f, p + "ffn_down_exps.bias")
        )

    def _shared(self, f: GGUFFile, p: str, backend: Backend, input_scale) -> tuple | None:
        """The shared experts' (gate_up, down, gate logit weight or None), if any."""
        if not f.has_tensor(p + "ffn_up_shexp.weight"):
            return None
        parts = [TensorPart(p + f"ffn_{n}_shexp.weight") for n in ("gate", "up")]
        gate_up = backend.linear(f, parts, input_scale)
        down = backend.linear(f, [TensorPart(p + "ffn_down_shexp.weight")])
        return gate_up, down, _optional(f, p + "ffn_gate_inp_shexp.weight")

    def weights(self) -> list[Any]:
        shared = list(self.shared[:2]) if self.shared else []
        return self.gate_up + self.down + shared

    def __call__(self, xn, layout: BatchLayout | None = None):
        """The normalized rows `xn` `[T, D]` through the chosen experts -> `[T, D]`."""
        if getattr(self.ops, "cuda", False) and _capturing():
            # refused before any copy to the host: runtime/decode_graphs.py then decodes
            # this model's static steps uncaptured
            raise RuntimeError("a MoE layer chooses its experts on the host: not capturable")
        x_in = self.ops.to_host(xn)
        if self.input_scale is not None:
            x_in = x_in * self.input_scale  # the router's input, as llama.cpp normalizes it
        logits = np.einsum("td,ed->te", x_in, self.router)  # [T, E]: each row's own dots
        if self.router_bias is not None:
            logits = logits + self.router_bias
        chosen, weights = route(logits, self.args, self.selection_bias)  # [T, k] each
        out = self._weighted_sum(self._expert_rows(xn, chosen), weights)
        if self.shared is not None:
            out = out + self._shared_out(xn, x_in, layout)
        return out

    def _expert_rows(self, xn, chosen: np.ndarray):
        """`[T, k, D]`: row t's output from its j-th chosen expert, each expert multiplied
        once over the rows that chose it."""
        t, k = chosen.shape
        flat = chosen.reshape(-1)  # [T*k]
        order = np.argsort(flat, kind="stable")  # (row, slot) pairs grouped by expert
        ends = np.cumsum(np.bincount(flat, minlength=self.args.n_experts))
        outs, start = [], 0
        for e, end in enumerate(ends.tolist()):
            if end > start:
                rows = self._index(order[start:end] // k)
                outs.append(self._expert(e, xn[rows]))
            start = end
        if self.host:
            sorted_out = np.concatenate(outs)  # [T*k, D], grouped by expert
        else:
            import torch

            sorted_out = torch.cat(outs)
        inverse = self._index(np.argsort(order, kind="stable"))
        return sorted_out[inverse].reshape(t, k, -1)

    def _expert(self, e: int, x):
        """Expert `e` over its rows `x` `[n, D]` -> `[n, D]`."""
        h = self.gate_up[e](x)  # [n, D] -> [n, 2F] (or [n, F])
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[e]
        if self.gated:
            ffn = h.shape[1] // 2
            h = self.act(h[:, :ffn], h[:, ffn:])  # [n, F]
        else:
            h = self.act(h)
        y = self.down[e](h)  # [n, F] -> [n, D]
        return y if self.down_bias is None else y + self.down_bias[e]

    def _weighted_sum(self, expert_rows, weights: np.ndarray):
        """sum_j weights[:, j] * rows[:, j], added in slot order as llama.cpp adds them."""
        w = weights if self.host else self._to_device(weights)
        out = expert_rows[:, 0] * w[:, 0:1]
        for j in range(1, weights.shape[1]):
            out = out + expert_rows[:, j] * w[:, j : j + 1]
        return out

    def _shared_out(self, xn, x_in: np.ndarray, layout: BatchLayout | None):
        gate_up, down, gate = self.shared
        out = gated_mlp(linear(xn, gate_up, layout), down, self.ops.silu_mul, layout)
        if gate is None:
            return out
        g = np.einsum("td,d->t", x_in, gate.reshape(-1))[:, None]  # [T, 1]
        g = sigmoid(g).astype(np.float32)
        return out * (g if self.host else self._to_device(g))

    def _index(self, idx: np.ndarray):
        return idx if self.host else self._to_device(idx)

    def _to_device(self, values: np.ndarray):
        import torch

        return torch.from_numpy(np.ascontiguousarray(values)).to(self.ops.device)


def _capturing() -> bool:
    import torch

    return torch.cuda.is_current_stream_capturing()


def _vectors(ops: Any, rows: np.ndarray | None) -> list | None:
    return None if rows is None else [ops.vector(np.ascontiguousarray(r)) for r in rows]


class MoEBlock(Block):
    """A decoder layer whose FFN is a `MoE` (its args a `MoEDecoderArgs`), after the
    layer's pre-norm (`ffn_norm`) where the block has one."""

    def build_mlp(self, f: GGUFFile, p: str, backend: Backend) -> None:
        norm = f.tensor(p + "ffn_norm.weight") if self.pre_norm else None
        act = self.shape.activation + "_mul"
        self.moe = MoE(f, p, self.args.moe, backend, self.ops, norm, act)

    def weights(self) -> list[Any]:
        return [self.wqkv, self.wo, *self.moe.weights()]

    def mlp(self, x, layout: BatchLayout):
        xn = self.ops.rms_normalize(x, self.args.norm_eps) if self.pre_norm else x
        return self.moe(xn, layout)
