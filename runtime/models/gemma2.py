"""Gemma 2: Gemma's pre and post norms around attention and FFN, GELU-tanh gated FFN,
embeddings times sqrt(dim), a sliding window on every other layer (the first included),
and soft caps: cap * tanh(x / cap) on every attention score and on the logits.
llama.cpp: src/models/gemma2.cpp (q's scale is 1/sqrt(dim / heads) for the 27B's 46
layers, else 1/sqrt(head size), whatever the config's query_pre_attn_scalar says);
convert_hf_to_gguf.py: conversion/gemma.py `Gemma2Model` (norm weights stored as 1 + w).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from runtime.errors import ModelFormatError
from runtime.gguf_file import GGUFFile
from runtime.models.base import rope_inv_freq
from runtime.models.layers import GLOBAL, BlockShape, Decoder, DecoderArgs, sliding_layers

SLIDING_WINDOW_PATTERN = 2  # llama.cpp's load_swa_pattern(ml, 2): even layers slide
DEFAULT_WINDOW = 4096  # llama.cpp's default for Gemma 2
LAYERS_OF_27B = 46
LOCAL = "local"


@dataclass
class Gemma2Args(DecoderArgs):
    local_rope_base: float = 10000.0

    def rope(self, layer: int) -> Hashable:
        return LOCAL if self.window(layer) is not None else GLOBAL


def _optional(value: object) -> float | None:
    return None if value is None or float(value) == 0.0 else float(value)


class Gemma2Model(Decoder):
    shape = BlockShape(norms="pre_post", activation="gelu_tanh")

    @staticmethod
    def read_args(f: GGUFFile) -> Gemma2Args:
        n_layers, dim = int(f.require("block_count")), int(f.require("embedding_length"))
        n_heads = int(f.require("attention.head_count"))
        if f.arch_value("rope.scaling.type") == "yarn":
            raise ModelFormatError(f"{f.path.name}: rope scaling 'yarn' is not supported")
        args = Gemma2Args.read(
            f,
            norm_eps=1e-6,
            embed_scale=float(np.float32(np.sqrt(dim))),
            sliding_window=int(f.arch_value("attention.sliding_window", DEFAULT_WINDOW)),
            sliding=sliding_layers(f, n_layers, SLIDING_WINDOW_PATTERN),
            attn_softcap=_optional(f.arch_value("attn_logit_softcapping")),
            final_softcap=_optional(f.arch_value("final_logit_softcapping")),
        )
        args.local_rope_base = float(f.arch_value("rope.freq_base_swa", args.rope_base))
        if n_layers == LAYERS_OF_27B:
            args.attn_scale = 1.0 / float(np.sqrt(dim / n_heads))
        return args

    def rope_freqs(self, f: GGUFFile) -> dict[Hashable, tuple]:
        a = self.args
        return {
            GLOBAL: (rope_inv_freq(a.n_rot, a.rope_base), a.rope_scale),
            LOCAL: (rope_inv_freq(a.n_rot, a.local_rope_base), a.rope_scale),
        }
