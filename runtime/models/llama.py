"""Llama-family decoder (Llama 2/3, TinyLlama, Mistral, SmolLM2): GQA, SwiGLU, RMSNorm, rope.

GGUF stores llama's q/k rows permuted for llama.cpp's adjacent-pair rope; we permute them
back at load (`BlockShape.permuted_qk`) so that attention can use the NeoX half-split
rotation on contiguous halves. Llama 3.x's rope scaling comes as the `rope_freqs` tensor
(convert_hf_to_gguf.py writes it from rope_scaling "llama3"), which `Decoder` reads.
"""

from __future__ import annotations

import numpy as np

from runtime.gguf_file import GGUFFile
from runtime.models.layers import BlockShape, Decoder, DecoderArgs, unpermute_order

__all__ = ["LlamaModel", "unpermute_order", "unpermute_rows"]


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w[unpermute_order(w.shape[0], n_heads)]


class LlamaModel(Decoder):
    """The whole decoder; `forward` returns final-normed hidden states, `logits` projects."""

    shape = BlockShape(permuted_qk=True)

    @staticmethod
    def read_args(f: GGUFFile) -> DecoderArgs:
        return DecoderArgs.read(f)
