"""OLMo 2: norms after each sublayer only (post_attention_norm, post_ffw_norm; the residual
stream itself is never normalized before a product), an RMSNorm over the whole q and k
projections before they are split into heads, NeoX rope on rows in order. OLMo 3's files
(same architecture) add a sliding window on three layers of four. llama.cpp:
src/models/olmo2.cpp; convert_hf_to_gguf.py: conversion/olmo.py `Olmo2Model`.
"""

from __future__ import annotations

from runtime.gguf_file import GGUFFile
from runtime.models.layers import BlockShape, Decoder, DecoderArgs, sliding_layers

SLIDING_WINDOW_PATTERN = 4  # llama.cpp's default for olmo2 (load_swa_pattern(ml, 4))


class Olmo2Model(Decoder):
    shape = BlockShape(norms="post", qk_norm="full")

    @staticmethod
    def read_args(f: GGUFFile) -> DecoderArgs:
        n_layers = int(f.require("block_count"))
        return DecoderArgs.read(
            f,
            norm_eps=1e-6,
            sliding_window=int(f.arch_value("attention.sliding_window", 0)),
            sliding=sliding_layers(f, n_layers, SLIDING_WINDOW_PATTERN),
        )
