"""SmolLM3: llama (q/k rows permuted by the converter, which reuses its LlamaModel) with
no rope in every fourth layer (NoPE): llama.cpp fixes the step at 4
(`n_no_rope_layer_step`, src/models/smollm3.cpp), as HF's default `no_rope_layer_interval`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from runtime.gguf_file import GGUFFile
from runtime.models.layers import GLOBAL, BlockShape, Decoder, DecoderArgs

NO_ROPE_LAYER_STEP = 4


@dataclass
class SmolLM3Args(DecoderArgs):
    def rope(self, layer: int) -> Hashable | None:
        return None if (layer + 1) % NO_ROPE_LAYER_STEP == 0 else GLOBAL


class SmolLM3Model(Decoder):
    shape = BlockShape(permuted_qk=True)

    @staticmethod
    def read_args(f: GGUFFile) -> SmolLM3Args:
        return SmolLM3Args.read(f, norm_eps=1e-6)
