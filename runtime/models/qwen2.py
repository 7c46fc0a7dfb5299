"""Qwen 2 / 2.5: llama's pre-norm block with a bias on the q, k and v products and NeoX
rope on rows the converter leaves in order. llama.cpp: src/models/qwen2.cpp (which, like
llama.cpp, ignores the config's sliding window); convert_hf_to_gguf.py: conversion/qwen.py
`Qwen2Model`.
"""

from __future__ import annotations

from runtime.gguf_file import GGUFFile
from runtime.models.layers import BlockShape, Decoder, DecoderArgs


class Qwen2Model(Decoder):
    shape = BlockShape(qkv_bias=True)

    @staticmethod
    def read_args(f: GGUFFile) -> DecoderArgs:
        return DecoderArgs.read(f, norm_eps=1e-6, rope_base=1_000_000.0)
