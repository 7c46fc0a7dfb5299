"""Tiny random GGUF models written with gguf's own `GGUFWriter`, for fast unit tests.

They have real tokenizers (a byte-level GPT-2 vocabulary for llama, a SentencePiece byte
vocabulary for gemma3) and quantized tensors (Q8_0, F16), so the whole loading path runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

Q8_0 = gguf.GGMLQuantizationType.Q8_0
F16 = gguf.GGMLQuantizationType.F16
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class TinyShape:
    n_layers: int = 2
    dim: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 96
    context_length: int = 256
    sliding_window: int = 8


def byte_level_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value (the table byte-level BPE uses)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _gpt2_vocab() -> tuple[list[str], list[int], list[str]]:
    bytes_ = byte_level_chars()
    space = bytes_[ord(" ")]
    merges = [f"{space} t", "h e", f"{space}t he", "i n", f"{space} a"]
    merged = [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + bytes_ + merged
    types = [3] * len(specials) + [1] * (len(bytes_) + len(merged))
    return tokens, types, merges


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    types = [3, 3, 3, 2, 3, 3]
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "▁t", "he", "▁the", "in", "▁a", "er"]
    tokens = specials + bytes_ + words
    scores = [0.0] * (len(specials) + len(bytes_)) + [-float(i) for i in range(len(words))]
    return tokens, scores, types + [6] * len(bytes_) + [1] * len(words)


def _add_gpt2_tokenizer(w: gguf.GGUFWriter, pre: str = "gpt2") -> int:
    """The GPT-2 vocabulary (`_gpt2_vocab`) with BOS = EOS = 0 and a ChatML template; its
    size. `pre`: the pre-tokenizer's name (llama.cpp reads only its own, "gpt-2")."""
    tokens, types, merges = _gpt2_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    return len(tokens)


def _add_quantized(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype) -> None:
    # the quantized array's byte layout tells the writer the logical shape
    writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def _add_float32(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype=None) -> None:
    """`_add_quantized`'s signature, kept float32 (`qtype` unused)."""
    writer.add_tensor(name, array.astype(np.float32))


def _norm(rng: np.random.Generator, n: int) -> np.ndarray:
    return 1 + 0.1 * rng.standard_normal(n).astype(np.float32)


def _weights(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)


def _writer(path: Path, arch: str, s: TinyShape) -> gguf.GGUFWriter:
    """A writer for `arch` holding the hyperparameters every architecture reads alike."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(s.n_layers)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(s.ffn_dim)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    return w


def write_tiny_llama(
    path: Path,
    shape: TinyShape | None = None,
    seed: int = 0,
    int_embeddings: bool = False,
    layer_type: gguf.GGMLQuantizationType | None = None,
) -> Path:
    """A tiny llama; `int_embeddings` stores token_embd as I32, a type no loader accepts;
    `layer_type` stores every layer weight in that one type (default: a Q8_0/F16 mix)."""
    s, rng = shape or TinyShape(), np.random.default_rng(seed)
    w = _writer(path, "llama", s)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    vocab = _add_gpt2_tokenizer(w)
    q_dim, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    if int_embeddings:
        w.add_tensor("token_embd.weight", np.zeros((vocab, s.dim), np.int32))
    else:
        _add_quantized(w, "token_embd.weight", _weights(rng, vocab, s.dim), Q8_0)
    w.add_tensor("output_norm.weight", _norm(rng, s.dim))
    _add_quantized(w, "output.weight", _weights(rng, vocab, s.dim), Q8_0)
    q8, f16 = layer_type or Q8_0, layer_type or F16
    for i in range(s.n_layers):
        p = f"blk.{i}."
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + norm + ".weight", _norm(rng, s.dim))
        _add_quantized(w, p + "attn_q.weight", _weights(rng, q_dim, s.dim), q8)
        _add_quantized(w, p + "attn_k.weight", _weights(rng, kv, s.dim), q8)
        _add_quantized(w, p + "attn_v.weight", _weights(rng, kv, s.dim), f16)
        _add_quantized(
            w, p + "attn_output.weight", _weights(rng, s.dim, s.n_heads * s.head_dim), q8
        )
        _add_quantized(w, p + "ffn_gate.weight", _weights(rng, s.ffn_dim, s.dim), q8)
        _add_quantized(w, p + "ffn_up.weight", _weights(rng, s.ffn_dim, s.dim), f16)
        _add_quantized(w, p + "ffn_down.weight", _weights(rng, s.dim, s.ffn_dim), q8)
    _finish(w)
    return path


@dataclass(frozen=True)
class TinyArch:
    """What a llama-like architecture's tiny GGUF holds beyond llama's tensors and keys:
    the variants runtime/models/layers.py composes."""

    norms: str = "pre"  # "pre", "pre_post" (gemma2), "post" (olmo2), "oai" (gpt-oss)
    qk_norm: str | None = None  # "head" (qwen3), "full" (olmo2)
    bias: bool = False  # q/k/v biases (qwen2)
    fused: bool = False  # attn_qkv and a gate+up ffn_up (phi3)
    key_length: int | None = None  # a head size other than dim / heads
    values: tuple[tuple[str, object], ...] = ()  # more `<arch>.` keys: (key, value)
    longrope: int = 0  # LongRoPE factors (phi3) for this many rotated dims
    experts: int = 0  # a MoE FFN of this many experts (qwen3moe) in place of the dense one
    expert_ffn: int = 32
    expert_type: gguf.GGMLQuantizationType | None = None  # every expert tensor's (gpt-oss)
    # gpt-oss: attn_sinks and attn_output's bias; biases on the router and every expert
    sinks: bool = False
    expert_biases: bool = False


TINY_ARCHS = {
    # with Qwen's long-context YaRN (factor 4 over an original context of 64)
    "qwen3": TinyArch(
        qk_norm="head",
        key_length=24,
        values=(
            ("rope.scaling.type", "yarn"),
            ("rope.scaling.factor", 4.0),
            ("rope.scaling.original_context_length", 64),
        ),
    ),
    "qwen2": TinyArch(bias=True),
    # 8 experts, 3 used: a batch's rows share some experts and not others
    "qwen3moe": TinyArch(
        qk_norm="head",
        experts=8,
        values=(("expert_count", 8), ("expert_used_count", 3), ("expert_feed_forward_length", 32)),
    ),
    # gpt-oss's: sinks, biases everywhere, MXFP4 experts (4, 2 used), a window on even
    # layers, YaRN (its real factor 32 over 4096 would leave a short context unscaled)
    "gpt-oss": TinyArch(
        norms="oai",
        bias=True,
        sinks=True,
        experts=4,
        expert_type=gguf.GGMLQuantizationType.MXFP4,
        expert_biases=True,
        values=(
            ("expert_count", 4),
            ("expert_used_count", 2),
            ("expert_feed_forward_length", 32),
            ("attention.sliding_window", 8),
            ("rope.scaling.type", "yarn"),
            ("rope.scaling.factor", 4.0),
            ("rope.scaling.original_context_length", 64),
        ),
    ),
    # Phi-4-mini's shape: 3/4 of each head rotated, LongRoPE (long factors: context 256 > 64)
    "phi3": TinyArch(
        fused=True,
        values=(
            ("rope.dimension_count", 12),
            ("rope.scaling.original_context_length", 64),
            ("rope.scaling.attn_factor", 1.2),
        ),
        longrope=12,
    ),
    "smollm3": TinyArch(),  # every fourth layer without rope
    # Ministral 3's: a head size other than dim / heads, YaRN, Llama 4's attention temperature
    "mistral3": TinyArch(
        key_length=24,
        values=(
            ("rope.scaling.type", "yarn"),
            ("rope.scaling.factor", 4.0),
            ("rope.scaling.original_context_length", 32),
            ("rope.scaling.yarn_log_multiplier", 1.0),
            ("attention.temperature_scale", 0.1),
        ),
    ),
    # OLMo 3's shape: a window of 8 on three layers of four (llama.cpp's default pattern)
    "olmo2": TinyArch(norms="post", qk_norm="full", values=(("attention.sliding_window", 8),)),
    "gemma2": TinyArch(
        norms="pre_post",
        values=(
            ("attention.sliding_window", 8),
            ("attn_logit_softcapping", 5.0),
            ("final_logit_softcapping", 3.0),
        ),
    ),
    # written by write_tiny_gemma4 (its layers differ in head size, KV heads and v)
    "gemma4": TinyArch(norms="pre_post", qk_norm="head"),
    "granite": TinyArch(
        values=(
            ("embedding_scale", 12.0),
            ("residual_scale", 0.22),
            ("attention.scale", 0.03),
            ("logit_scale", 8.0),
        )
    ),
}


def _add_value(w: gguf.GGUFWriter, arch: str, key: str, value: object) -> None:
    name = f"{arch}.{key}"
    if isinstance(value, str):
        w.add_string(name, value)
    elif isinstance(value, bool):
        w.add_bool(name, value)
    elif isinstance(value, int):
        w.add_uint32(name, value)
    elif isinstance(value, float):
        w.add_float32(name, value)
    else:
        w.add_array(name, list(value))  # type: ignore[arg-type]


def write_tiny_arch(path: Path, arch: str, shape: TinyShape | None = None, seed: int = 0) -> Path:
    """A tiny model of `arch` (a key of TINY_ARCHS): llama's GPT-2 vocabulary, weights Q8_0
    and F16, with the tensors and keys its variant adds, named as llama.cpp's converter
    names them (an untied head; q/k rows unpermuted, as for NeoX-rope architectures)."""
    if arch == "gemma4":
        return write_tiny_gemma4(path, shape, seed)
    spec, s, rng = TINY_ARCHS[arch], shape or TinyShape(n_layers=4), np.random.default_rng(seed)
    w = _writer(path, arch, s)
    head_dim = spec.key_length or s.dim // s.n_heads
    if spec.key_length:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    for key, value in spec.values:
        _add_value(w, arch, key, value)
    vocab = _add_gpt2_tokenizer(w)
    _add_quantized(w, "token_embd.weight", _weights(rng, vocab, s.dim), Q8_0)
    w.add_tensor("output_norm.weight", _norm(rng, s.dim))
    _add_quantized(w, "output.weight", _weights(rng, vocab, s.dim), Q8_0)
    if spec.longrope:
        for name in ("rope_factors_long", "rope_factors_short"):
            w.add_tensor(name + ".weight", 1 + rng.random(spec.longrope // 2).astype(np.float32))
    for i in range(s.n_layers):
        _add_tiny_layer(w, f"blk.{i}.", spec, s, head_dim, rng)
    _finish(w)
    return path


def write_tiny_gemma4(
    path: Path, shape: TinyShape | None = None, seed: int = 0, float32: bool = False
) -> Path:
    """A tiny Gemma 4 as llama.cpp's converter writes one: sliding layers (head size
    `head_dim`, `n_kv_heads`, all of it rotated at base 1e4) between full ones (twice the
    head size, one KV head, no attn_v: v is k's projection; a quarter of each head rotated
    through rope_freqs), per-layer output scales, a final softcap, a tied head; and E2B's
    parts: per-layer embeddings of 32 and, from 4 layers, the last two layers sharing the
    KV of the two before them (q alone, their FFN twice as wide); and 26B-A4B's: 4 experts
    (2 used) beside each dense FFN. `float32`: every weight float32 and llama.cpp's
    pre-tokenizer name, for llama.cpp to read."""
    s, rng = shape or TinyShape(n_layers=4), np.random.default_rng(seed)
    add = _add_float32 if float32 else _add_quantized
    sliding = [i % 2 == 0 for i in range(s.n_layers)]
    swa_dim, full_dim, per_layer = s.head_dim, 2 * s.head_dim, 32
    first_shared = s.n_layers - 2 if s.n_layers >= 4 else s.n_layers
    ffn = [s.ffn_dim if i < first_shared else 2 * s.ffn_dim for i in range(s.n_layers)]
    w = gguf.GGUFWriter(str(path), "gemma4")
    w.add_block_count(s.n_layers)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.dim)
    w.add_feed_forward_length(ffn)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv([s.n_kv_heads if slides else 1 for slides in sliding])
    w.add_key_length(full_dim)
    w.add_value_length(full_dim)
    w.add_key_length_swa(swa_dim)
    w.add_value_length_swa(swa_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_rope_freq_base_swa(10_000.0)
    w.add_rope_dimension_count(full_dim)
    w.add_rope_dimension_count_swa(swa_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(s.sliding_window)
    w.add_sliding_window_pattern(sliding)
    w.add_shared_kv_layers(s.n_layers - first_shared)
    w.add_embedding_length_per_layer_input(per_layer)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(32)
    w.add_final_logit_softcapping(30.0)
    vocab = _add_gpt2_tokenizer(w, "gpt-2" if float32 else "gpt2")
    add(w, "token_embd.weight", _weights(rng, vocab, s.dim), Q8_0)
    w.add_tensor("output_norm.weight", _norm(rng, s.dim))
    rotated = full_dim // 8  # of full_dim / 2 frequencies: partial_rotary_factor 0.25
    factors = [1.0] * rotated + [1e30] * (full_dim // 2 - rotated)
    w.add_tensor("rope_freqs.weight", np.array(factors, np.float32))
    all_inputs = s.n_layers * per_layer
    add(w, "per_layer_token_embd.weight", _weights(rng, vocab, all_inputs), Q8_0)
    add(w, "per_layer_model_proj.weight", _weights(rng, all_inputs, s.dim), Q8_0)
    w.add_tensor("per_layer_proj_norm.weight", _norm(rng, per_layer))
    for i, slides in enumerate(sliding):
        p, head = f"blk.{i}.", swa_dim if slides else full_dim
        kv = (s.n_kv_heads if slides else 1) * head
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.add_tensor(p + norm + ".weight", _norm(rng, s.dim))
        w.add_tensor(p + "attn_q_norm.weight", _norm(rng, head))
        add(w, p + "attn_q.weight", _weights(rng, s.n_heads * head, s.dim), Q8_0)
        if i < first_shared:
            w.add_tensor(p + "attn_k_norm.weight", _norm(rng, head))
            add(w, p + "attn_k.weight", _weights(rng, kv, s.dim), Q8_0)
        if slides and i < first_shared:
            add(w, p + "attn_v.weight", _weights(rng, kv, s.dim), F16)
        add(w, p + "attn_output.weight", _weights(rng, s.dim, s.n_heads * head), Q8_0)
        add(w, p + "ffn_gate.weight", _weights(rng, ffn[i], s.dim), Q8_0)
        add(w, p + "ffn_up.weight", _weights(rng, ffn[i], s.dim), F16)
        add(w, p + "ffn_down.weight", _weights(rng, s.dim, ffn[i]), Q8_0)
        _add_tiny_gemma4_experts(w, p, s.dim, rng, add)
        add(w, p + "inp_gate.weight", _weights(rng, per_layer, s.dim), Q8_0)
        add(w, p + "proj.weight", _weights(rng, s.dim, per_layer), F16)
        w.add_tensor(p + "post_norm.weight", _norm(rng, s.dim))
        w.add_tensor(p + "layer_output_scale.weight", np.array([0.8 + 0.1 * i], np.float32))
    _finish(w)
    return path


def _add_tiny_gemma4_experts(w: gguf.GGUFWriter, p: str, dim: int, rng, add) -> None:
    """Gemma 4 26B-A4B's expert tensors for one layer: 4 experts of 32, a router with its
    input scale, the norms around them, each expert's output scale."""
    w.add_tensor(p + "ffn_gate_inp.weight", 4 * _weights(rng, 4, dim))
    w.add_tensor(p + "ffn_gate_inp.scale", _norm(rng, dim))
    for norm in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
        w.add_tensor(p + norm + ".weight", _norm(rng, dim))
    add(w, p + "ffn_gate_exps.weight", _weights(rng, 4, 32, dim), Q8_0)
    add(w, p + "ffn_up_exps.weight", _weights(rng, 4, 32, dim), F16)
    add(w, p + "ffn_down_exps.weight", _weights(rng, 4, dim, 32), Q8_0)
    w.add_tensor(p + "ffn_down_exps.scale", _norm(rng, 4))


def _add_tiny_layer(
    w: gguf.GGUFWriter, p: str, spec: TinyArch, s: TinyShape, head_dim: int, rng
) -> None:
    q_dim, kv = s.n_heads * head_dim, s.n_kv_heads * head_dim
    norms = {"pre": ("attn_norm", "ffn_norm"), "post": ("post_attention_norm", "post_ffw_norm")}
    norms["pre_post"] = norms["pre"] + norms["post"]
    norms["oai"] = ("attn_norm", "post_attention_norm")  # the second before the FFN
    for norm in norms[spec.norms]:
        w.add_tensor(p + norm + ".weight", _norm(rng, s.dim))
    if spec.qk_norm:
        q_n, k_n = (head_dim, head_dim) if spec.qk_norm == "head" else (q_dim, kv)
        w.add_tensor(p + "attn_q_norm.weight", _norm(rng, q_n))
        w.add_tensor(p + "attn_k_norm.weight", _norm(rng, k_n))
    if spec.fused:
        _add_quantized(w, p + "attn_qkv.weight", _weights(rng, q_dim + 2 * kv, s.dim), Q8_0)
        _add_quantized(w, p + "ffn_up.weight", _weights(rng, 2 * s.ffn_dim, s.dim), F16)
    else:
        for name, rows, qtype in (("q", q_dim, Q8_0), ("k", kv, Q8_0), ("v", kv, F16)):
            _add_quantized(w, p + f"attn_{name}.weight", _weights(rng, rows, s.dim), qtype)
    if spec.experts:
        _add_tiny_experts(w, p, spec, s, rng)
    elif not spec.fused:
        _add_quantized(w, p + "ffn_gate.weight", _weights(rng, s.ffn_dim, s.dim), Q8_0)
        _add_quantized(w, p + "ffn_up.weight", _weights(rng, s.ffn_dim, s.dim), F16)
    if spec.bias:
        for name, rows in (("q", q_dim), ("k", kv), ("v", kv)):
            bias = 0.5 * rng.standard_normal(rows).astype(np.float32)
            w.add_tensor(p + f"attn_{name}.bias", bias)
    _add_quantized(w, p + "attn_output.weight", _weights(rng, s.dim, q_dim), Q8_0)
    if spec.sinks:
        w.add_tensor(p + "attn_output.bias", 0.5 * rng.standard_normal(s.dim).astype(np.float32))
        w.add_tensor(p + "attn_sinks.weight", 2 * rng.standard_normal(s.n_heads).astype(np.float32))
    if not spec.experts:
        _add_quantized(w, p + "ffn_down.weight", _weights(rng, s.dim, s.ffn_dim), Q8_0)


def _add_tiny_experts(w: gguf.GGUFWriter, p: str, spec: TinyArch, s: TinyShape, rng) -> None:
    """A float32 router and 3-D expert tensors `[E, out, in]`, named as llama.cpp's
    converter names them; the router's rows spread so that tokens choose different experts."""
    e, f = spec.experts, spec.expert_ffn
    w.add_tensor(p + "ffn_gate_inp.weight", 4 * _weights(rng, e, s.dim))
    q8, f16 = spec.expert_type or Q8_0, spec.expert_type or F16
    _add_quantized(w, p + "ffn_gate_exps.weight", _weights(rng, e, f, s.dim), q8)
    _add_quantized(w, p + "ffn_up_exps.weight", _weights(rng, e, f, s.dim), f16)
    _add_quantized(w, p + "ffn_down_exps.weight", _weights(rng, e, s.dim, f), q8)
    if spec.expert_biases:
        for name, shape in (("gate_inp", (e,)), ("gate_exps", (e, f)), ("up_exps", (e, f))):
            w.add_tensor(
                p + f"ffn_{name}.bias", 0.5 * rng.standard_normal(shape).astype(np.float32)
            )
        bias = 0.5 * rng.standard_normal((e, s.dim)).astype(np.float32)
        w.add_tensor(p + "ffn_down_exps.bias", bias)


def _gemma3_writer(
    path: Path, s: TinyShape, tokens: list[str], scores: list[float], types: list[int]
) -> gguf.GGUFWriter:
    """A gemma3 writer with its hyperparameters and SentencePiece vocabulary set."""
    w = _writer(path, "gemma3", s)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(s.sliding_window)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    return w


def write_tiny_gemma3(path: Path, shape: TinyShape | None = None, seed: int = 0) -> Path:
    s, rng = shape or TinyShape(n_layers=6, head_dim=32), np.random.default_rng(seed)
    tokens, scores, types = _spm_vocab()
    w = _gemma3_writer(path, s, tokens, scores, types)
    vocab, q_dim, kv = len(tokens), s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    _add_quantized(w, "token_embd.weight", _weights(rng, vocab, s.dim), Q8_0)
    w.add_tensor("output_norm.weight", _norm(rng, s.dim))
    for i in range(s.n_layers):
        p = f"blk.{i}."
        norms = ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")
        for norm in norms:
            w.add_tensor(p + norm + ".weight", _norm(rng, s.dim))
        for norm in ("attn_q_norm", "attn_k_norm"):
            w.add_tensor(p + norm + ".weight", _norm(rng, s.head_dim))
        _add_quantized(w, p + "attn_q.weight", _weights(rng, q_dim, s.dim), Q8_0)
        _add_quantized(w, p + "attn_k.weight", _weights(rng, kv, s.dim), Q8_0)
        _add_quantized(w, p + "attn_v.weight", _weights(rng, kv, s.dim), Q8_0)
        _add_quantized(w, p + "attn_output.weight", _weights(rng, s.dim, q_dim), Q8_0)
        _add_quantized(w, p + "ffn_gate.weight", _weights(rng, s.ffn_dim, s.dim), Q8_0)
        _add_quantized(w, p + "ffn_up.weight", _weights(rng, s.ffn_dim, s.dim), Q8_0)
        _add_quantized(w, p + "ffn_down.weight", _weights(rng, s.dim, s.ffn_dim), Q8_0)
    _finish(w)
    return path


# Gemma 3 270M Q4_K_M's weight types, one per role; gguf's writer cannot quantize the
# K-quants, so their blocks are random codes under small scales (valid blocks all the same)
GEMMA_TYPES = {
    "attn_q": gguf.GGMLQuantizationType.Q5_0,
    "attn_k": gguf.GGMLQuantizationType.Q5_0,
    "attn_v": gguf.GGMLQuantizationType.Q6_K,
    "attn_output": gguf.GGMLQuantizationType.Q4_K,
    "ffn_gate": gguf.GGMLQuantizationType.Q5_0,
    "ffn_up": gguf.GGMLQuantizationType.Q4_K,
    "ffn_down": gguf.GGMLQuantizationType.Q6_K,
}


def _k_quant_blocks(rng: np.random.Generator, rows: int, cols: int, qtype) -> np.ndarray:
    """Random Q4_K / Q6_K blocks `[rows, bytes]`: codes and sub-block scales at random, the
    half-precision super-block scale(s) small enough to keep activations moderate."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block_size
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q4_K:  # d, dmin first
        raw[:, 0:4] = np.array([2e-3, 1e-3], np.float16).view(np.uint8)
    else:  # Q6_K: ql, qh, int8 scales, then d last
        raw[:, -2:] = np.array([2e-4], np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_tiny_gemma3_types(path: Path, vocab_rows: int = 20000, seed: int = 0) -> Path:
    """A tiny gemma3 whose layer weights have Gemma 3 Q4_K_M's types (GEMMA_TYPES: Q4_K,
    Q5_0, Q6_K; embedding Q8_0) and whose tied embedding / head has `vocab_rows` rows
    (more than one chunk of a head's upload), with a sliding window of 24 over 6 layers."""
    s = TinyShape(
        n_layers=6,
        dim=256,
        n_heads=4,
        n_kv_heads=1,
        head_dim=64,
        ffn_dim=512,
        context_length=512,
        sliding_window=24,
    )
    rng = np.random.default_rng(seed)
    tokens, scores, types = _spm_vocab()
    filler = vocab_rows - len(tokens)
    tokens += [f"<unused{i}>" for i in range(filler)]
    scores += [-100.0] * filler
    types += [4] * filler  # user-defined: never produced by the tokenizer from text
    w = _gemma3_writer(path, s, tokens, scores, types)
    q_dim, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    _add_quantized(w, "token_embd.weight", _weights(rng, vocab_rows, s.dim), Q8_0)
    w.add_tensor("output_norm.weight", _norm(rng, s.dim))
    shapes = {
        "attn_q": (q_dim, s.dim),
        "attn_k": (kv, s.dim),
        "attn_v": (kv, s.dim),
        "attn_output": (s.dim, q_dim),
        "ffn_gate": (s.ffn_dim, s.dim),
        "ffn_up": (s.ffn_dim, s.dim),
        "ffn_down": (s.dim, s.ffn_dim),
    }
    for i in range(s.n_layers):
        p = f"blk.{i}."
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.add_tensor(p + norm + ".weight", _norm(rng, s.dim))
        for norm in ("attn_q_norm", "attn_k_norm"):
            w.add_tensor(p + norm + ".weight", _norm(rng, s.head_dim))
        for role, qtype in GEMMA_TYPES.items():
            rows, cols = shapes[role]
            if qtype in (gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K):
                blocks = _k_quant_blocks(rng, rows, cols, qtype)
                w.add_tensor(p + role + ".weight", blocks, raw_dtype=qtype)
            else:
                _add_quantized(w, p + role + ".weight", _weights(rng, rows, cols), qtype)
    _finish(w)
    return path


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


LORA_TARGETS = ("attn_q", "attn_v", "ffn_up")


def write_lora(
    path: Path,
    base: Path,
    targets: tuple[str, ...] = LORA_TARGETS,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    architecture: str | None = None,
    extra: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> Path:
    """A LoRA adapter in llama.cpp's GGUF layout for the model at `base`: random A `[rank,
    in]` and B `[out, rank]` (F32) for `<target>.weight` of every layer; `extra` adds (or
    replaces) pairs by base tensor name, e.g. to write a bad adapter."""
    reader = gguf.GGUFReader(base)
    arch = architecture or reader.fields["general.architecture"].contents()
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    rng = np.random.default_rng(seed)
    pairs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, (out, inp) in ((n, s) for n, s in shapes.items() if len(s) == 2):
        if name.startswith("blk.") and name.split(".")[2] in targets:
            a = (rng.standard_normal((rank, inp)) / np.sqrt(inp)).astype(np.float32)
            b = (0.5 * rng.standard_normal((out, rank)) / np.sqrt(rank)).astype(np.float32)
            pairs[name] = (a, b)
    pairs.update(extra or {})
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for name, (a, b) in pairs.items():
        w.add_tensor(name + ".lora_a", a)
        w.add_tensor(name + ".lora_b", b)
    _finish(w)
    return path
