"""Phi-3 / Phi-4-mini: llama's pre-norm block over fused tensors (attn_qkv holds q, k and v
rows; ffn_up holds the gate's rows then the up's), NeoX rope on the first
`rope.dimension_count` dims of each head (Phi-4-mini rotates 3/4 of them), and LongRoPE:
per-frequency factors `rope_factors_long` / `rope_factors_short` and an attention factor
that multiplies rope's cos and sin. llama.cpp: src/models/phi3.cpp (its sliding window is
disabled there, so here too), `llama_model::get_rope_factors`; convert_hf_to_gguf.py:
conversion/phi.py `Phi3MiniModel`.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from runtime.gguf_file import GGUFFile
from runtime.models.layers import GLOBAL, Decoder, DecoderArgs


def longrope_factors(f: GGUFFile, context_length: int) -> np.ndarray | None:
    """The factors llama.cpp picks: the long ones when the context served is longer than
    the one the model was trained at (we serve `context_length`), else the short ones."""
    if not f.has_tensor("rope_factors_long.weight"):
        return None
    original = int(f.arch_value("rope.scaling.original_context_length", context_length))
    long = context_length > original
    return f.tensor("rope_factors_long.weight" if long else "rope_factors_short.weight")


class Phi3Model(Decoder):
    @staticmethod
    def read_args(f: GGUFFile) -> DecoderArgs:
        return DecoderArgs.read(f)

    def rope_freqs(self, f: GGUFFile) -> dict[Hashable, tuple]:
        """LongRoPE's factors divide the frequencies; its attention factor
        (rope.scaling.attn_factor, `Decoder.rope`) multiplies cos and sin, so only the
        rotated dims (not a partial rope's others)."""
        return {GLOBAL: self.rope(longrope_factors(f, self.args.context_length))}
