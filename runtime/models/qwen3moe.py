"""Qwen 3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen 3's attention (an RMSNorm over each
head of q and k before NeoX rope) and a mixture-of-experts FFN in every layer: a softmax
router over `expert_count` experts, the top `expert_used_count` weighted by their
probabilities divided by their sum (llama.cpp hard-codes both, whatever the file says),
SwiGLU experts. llama.cpp: src/models/qwen3moe.cpp; convert_hf_to_gguf.py: conversion/qwen.py
`Qwen3MoeModel`.
"""

from __future__ import annotations

from runtime.gguf_file import GGUFFile
from runtime.models.layers import BlockShape, Decoder
from runtime.models.moe import MoEArgs, MoEBlock, MoEDecoderArgs


class Qwen3MoeModel(Decoder):
    shape = BlockShape(qk_norm="head")
    block = MoEBlock

    @staticmethod
    def read_args(f: GGUFFile) -> MoEDecoderArgs:
        moe = MoEArgs.read(f, gating="softmax", norm_weights=True)
        return MoEDecoderArgs.read(f, norm_eps=1e-6, rope_base=1_000_000.0, moe=moe)
