"""IBM Granite (3.x dense): llama (q/k rows permuted by the converter's LlamaModel) with
four multipliers from the file: the embeddings' (`embedding_scale`), each sublayer's
output before its residual add (`residual_scale`), q.k's in place of 1/sqrt(Dh)
(`attention.scale`) and the logits' divisor (`logit_scale`). llama.cpp:
src/models/granite.cpp; convert_hf_to_gguf.py: conversion/granite.py.
"""

from __future__ import annotations

from runtime.gguf_file import GGUFFile
from runtime.models.layers import BlockShape, Decoder, DecoderArgs


class GraniteModel(Decoder):
    shape = BlockShape(permuted_qk=True)

    @staticmethod
    def read_args(f: GGUFFile) -> DecoderArgs:
        attn_scale = float(f.arch_value("attention.scale", 0.0))
        return DecoderArgs.read(
            f,
            attn_scale=attn_scale or None,  # 0: llama.cpp's 1/sqrt(Dh)
            embed_scale=float(f.arch_value("embedding_scale", 1.0)),
            residual_scale=float(f.arch_value("residual_scale", 1.0)),
            logit_scale=1.0 / float(f.require("logit_scale")),
        )
