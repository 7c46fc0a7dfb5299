"""Gemma 3 decoder: q/k RMSNorm, pre and post norms around attention and FFN, GELU-tanh
gated FFN, embeddings scaled by sqrt(dim), and interleaved attention: five sliding-window
layers (their own rope base) to every global layer.

The GGUF converter stores Gemma's norm weights as (1 + w), so `rms_norm` multiplies as-is.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from runtime.errors import ModelFormatError
from runtime.gguf_file import GGUFFile
from runtime.models.base import rope_inv_freq
from runtime.models.layers import GLOBAL, BlockShape, Decoder, DecoderArgs

SLIDING_WINDOW_PATTERN = 6  # every 6th layer is global (llama.cpp and HF agree)
LOCAL_ROPE_BASE = 10000.0
LOCAL = "local"  # the sliding layers' rope key


@dataclass
class Gemma3Args(DecoderArgs):
    local_rope_base: float = LOCAL_ROPE_BASE
    sliding_window: int = 0

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Gemma3Args:
        dim = int(f.require("embedding_length"))
        if f.arch_value("rope.scaling.type") == "yarn":
            raise ModelFormatError(f"{f.path.name}: rope scaling 'yarn' is not supported")
        return cls.read(
            f,
            norm_eps=1e-6,
            rope_base=1_000_000.0,
            local_rope_base=float(f.arch_value("rope.freq_base_swa", LOCAL_ROPE_BASE)),
            sliding_window=int(f.require("attention.sliding_window")),
            embed_scale=float(np.float32(np.sqrt(dim))),
        )

    def is_sliding(self, layer: int) -> bool:
        return (layer + 1) % SLIDING_WINDOW_PATTERN != 0

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None

    def rope(self, layer: int) -> Hashable:
        return LOCAL if self.is_sliding(layer) else GLOBAL


class Gemma3Model(Decoder):
    """The whole decoder; `forward` returns final-normed hidden states, `logits` projects."""

    shape = BlockShape(norms="pre_post", qk_norm="head", activation="gelu_tanh")

    @staticmethod
    def read_args(f: GGUFFile) -> Gemma3Args:
        return Gemma3Args.from_gguf(f)

    def rope_freqs(self, f: GGUFFile) -> dict[Hashable, tuple]:
        a = self.args
        return {
            GLOBAL: (rope_inv_freq(a.head_dim, a.rope_base), a.rope_scale),
            LOCAL: (rope_inv_freq(a.head_dim, a.local_rope_base), 1.0),
        }
