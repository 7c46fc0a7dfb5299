"""Mistral 3 (Mistral Small 3.x's text model): llama's block on the rows llama's converter
permutes (conversion/mistral3.py `Ministral3Model` is a LlamaModel); llama.cpp:
src/models/mistral3.cpp. Its variants we do not run are refused at load: Llama 4's
attention temperature (`attention.temperature_scale`, Ministral 3), whose files also
use yarn rope (refused by GGUFFile.linear_rope_scale), and the MoE feed-forward.
"""

from __future__ import annotations

from runtime.errors import ModelFormatError
from runtime.gguf_file import GGUFFile
from runtime.models.layers import BlockShape, Decoder, DecoderArgs


class Mistral3Model(Decoder):
    shape = BlockShape(permuted_qk=True)

    @staticmethod
    def read_args(f: GGUFFile) -> DecoderArgs:
        if float(f.arch_value("attention.temperature_scale", 0.0)) != 0.0:
            raise ModelFormatError(
                f"{f.path.name}: mistral3 with attention temperature scaling is not supported"
            )
        if f.has_tensor("blk.0.ffn_gate_inp.weight"):
            raise ModelFormatError(f"{f.path.name}: mistral3 with MoE layers is not supported")
        return DecoderArgs.read(f)
