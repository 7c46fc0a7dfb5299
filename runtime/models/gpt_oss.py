"""gpt-oss (OpenAI's MoE): llama's pre-norm block with q/k/v and output biases, a learned
sink logit per head in attention's softmax (attn_sinks), a sliding window on every other
layer (the first included), YaRN rope alike on every layer, NeoX rope on rows in order; the
FFN (after the norm GGUF names post_attention_norm) is a MoE: the top k of the router's
biased logits, a softmax over those k, experts with biases on gate, up and down and the
clamped swiglu-oai activation (ops.swiglu_oai_mul), their weights often MXFP4. llama.cpp:
src/models/openai-moe.cpp, build_moe_ffn in src/llama-graph.cpp (LLM_FFN_SWIGLU_OAI_MOE,
LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT); convert_hf_to_gguf.py: conversion/gpt_oss.py.
"""

from __future__ import annotations

from runtime.gguf_file import GGUFFile
from runtime.kernels import Backend
from runtime.models.layers import BlockShape, Decoder, sliding_layers
from runtime.models.moe import MoE, MoEArgs, MoEBlock, MoEDecoderArgs

SLIDING_WINDOW_PATTERN = 2  # llama.cpp's load_swa_pattern(ml, 2): even layers slide


class GptOssBlock(MoEBlock):
    def build_mlp(self, f: GGUFFile, p: str, backend: Backend) -> None:
        norm = f.tensor(p + "post_attention_norm.weight")  # the FFN's pre-norm
        self.moe = MoE(f, p, self.args.moe, backend, self.ops, norm, "swiglu_oai_mul")


class GptOssModel(Decoder):
    shape = BlockShape(qkv_bias=True)
    block = GptOssBlock

    @staticmethod
    def read_args(f: GGUFFile) -> MoEDecoderArgs:
        n_layers = int(f.require("block_count"))
        return MoEDecoderArgs.read(
            f,
            sliding_window=int(f.require("attention.sliding_window")),
            sliding=sliding_layers(f, n_layers, SLIDING_WINDOW_PATTERN),
            moe=MoEArgs.read(f, gating="softmax_weight", norm_weights=False, weights_scale=1.0),
        )
