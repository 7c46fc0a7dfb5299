"""Mistral 3 (Mistral Small 3.x's text model, Ministral 3): llama's block on the rows
llama's converter permutes (conversion/mistral3.py `Ministral3Model` is a LlamaModel);
Ministral 3 adds YaRN rope and Llama 4's attention temperature: q times
1 + t * log(floor(p / n) + 1), t `attention.temperature_scale`, n the original context.
llama.cpp: src/models/mistral3.cpp. Its MoE feed-forward is refused at load.
"""

from __future__ import annotations

from runtime.errors import ModelFormatError
from runtime.gguf_file import GGUFFile
from runtime.models.layers import BlockShape, Decoder, DecoderArgs


class Mistral3Model(Decoder):
    shape = BlockShape(permuted_qk=True)

    @staticmethod
    def read_args(f: GGUFFile) -> DecoderArgs:
        if f.has_tensor("blk.0.ffn_gate_inp.weight"):
            raise ModelFormatError(f"{f.path.name}: mistral3 with MoE layers is not supported")
        context = int(f.require("context_length"))
        return DecoderArgs.read(
            f,
            q_temperature=float(f.arch_value("attention.temperature_scale", 0.0)),
            q_temperature_floor=int(f.arch_value("rope.scaling.original_context_length", context)),
        )
