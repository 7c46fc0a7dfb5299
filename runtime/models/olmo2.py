"""OLMo 2: norms after each sublayer only (post_attention_norm, post_ffw_norm; the residual
stream itself is never normalized before a product), an RMSNorm over the whole q and k
projections before they are split into heads, NeoX rope on rows in order. OLMo 3's files
(same architecture) add a sliding window on three layers of four, and YaRN on the others. llama.cpp:
src/models/olmo2.cpp; convert_hf_to_gguf.py: conversion/olmo.py `Olmo2Model`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from runtime.gguf_file import GGUFFile
from runtime.models.base import rope_inv_freq
from runtime.models.layers import GLOBAL, BlockShape, Decoder, DecoderArgs, sliding_layers

SLIDING_WINDOW_PATTERN = 4  # llama.cpp's default for olmo2 (load_swa_pattern(ml, 4))
LOCAL = "local"


@dataclass
class Olmo2Args(DecoderArgs):
    def rope(self, layer: int) -> Hashable:
        return LOCAL if self.window(layer) is not None else GLOBAL


class Olmo2Model(Decoder):
    shape = BlockShape(norms="post", qk_norm="full")

    @staticmethod
    def read_args(f: GGUFFile) -> Olmo2Args:
        n_layers = int(f.require("block_count"))
        return Olmo2Args.read(
            f,
            norm_eps=1e-6,
            sliding_window=int(f.arch_value("attention.sliding_window", 0)),
            sliding=sliding_layers(f, n_layers, SLIDING_WINDOW_PATTERN),
        )

    def rope_freqs(self, f: GGUFFile) -> dict[Hashable, tuple]:
        """OLMo 3's sliding layers rotate without the global layers' YaRN (olmo2.cpp: freq
        scale and attention factor 1, no ramp) at the same base: llama.cpp reads
        rope.freq_base_swa for olmo2 but its graph rotates with the main base."""
        a = self.args
        return {GLOBAL: self.rope(), LOCAL: (rope_inv_freq(a.n_rot, a.rope_base), 1.0)}
