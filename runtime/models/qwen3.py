"""Qwen 3 (dense): llama's pre-norm block with an RMSNorm over each head of q and k before
rope, NeoX rope on rows the converter leaves in order, and a head size of its own
(`attention.key_length`, 128 where dim / heads is 80 or more). llama.cpp:
src/models/qwen3.cpp; convert_hf_to_gguf.py: conversion/qwen.py `Qwen3Model`.
"""

from __future__ import annotations

from runtime.gguf_file import GGUFFile
from runtime.models.layers import BlockShape, Decoder, DecoderArgs


class Qwen3Model(Decoder):
    shape = BlockShape(qk_norm="head")

    @staticmethod
    def read_args(f: GGUFFile) -> DecoderArgs:
        return DecoderArgs.read(f, norm_eps=1e-6, rope_base=1_000_000.0)
