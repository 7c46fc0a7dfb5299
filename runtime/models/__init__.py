"""Model architectures, one file each, chosen by the GGUF's `general.architecture`."""

from __future__ import annotations

from runtime.errors import ModelFormatError
from runtime.gguf_file import GGUFFile, expert_tensor
from runtime.kernels import Backend, get_backend
from runtime.lora import LinearSources
from runtime.models.gemma2 import Gemma2Model
from runtime.models.gemma3 import Gemma3Model
from runtime.models.gemma4 import Gemma4Model
from runtime.models.gpt_oss import GptOssModel
from runtime.models.granite import GraniteModel
from runtime.models.layers import Decoder
from runtime.models.llama import LlamaModel
from runtime.models.mistral3 import Mistral3Model
from runtime.models.olmo2 import Olmo2Model
from runtime.models.phi3 import Phi3Model
from runtime.models.qwen2 import Qwen2Model
from runtime.models.qwen3 import Qwen3Model
from runtime.models.qwen3moe import Qwen3MoeModel
from runtime.models.qwen35 import Qwen35Model
from runtime.models.smollm3 import SmolLM3Model

# GGUF general.architecture -> its model class: the one registry (`llmq models --supported`)
ARCHITECTURES: dict[str, type[Decoder]] = {
    "llama": LlamaModel,
    "gemma3": Gemma3Model,
    "qwen3": Qwen3Model,
    "qwen3moe": Qwen3MoeModel,
    "qwen35": Qwen35Model,
    "gpt-oss": GptOssModel,
    "qwen2": Qwen2Model,
    "phi3": Phi3Model,
    "smollm3": SmolLM3Model,
    "olmo2": Olmo2Model,
    "granite": GraniteModel,
    "mistral3": Mistral3Model,
    "gemma2": Gemma2Model,
    "gemma4": Gemma4Model,
}


def load_model(gguf_file: GGUFFile, backend: Backend | None = None) -> Decoder:
    """Build the architecture's model from the file, its weights stored as `backend` keeps
    them (default: `get_backend()`, torch where installed)."""
    arch = gguf_file.architecture
    model_class = ARCHITECTURES.get(arch)
    if model_class is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ModelFormatError(
            f"{gguf_file.path.name}: architecture {arch!r} is not supported "
            f"(supported: {supported})"
        )
    backend = backend or get_backend()
    recorder = LinearSources(backend)
    with backend.loading(gguf_file):
        model = model_class(gguf_file, recorder)
    model.architecture, model.linear_sources = arch, recorder.sources
    return model


LINEAR_SUFFIXES = ("_q.weight", "_k.weight", "_v.weight", "_qkv.weight", "_output.weight")
LINEAR_SUFFIXES += ("_gate.weight",)
LINEAR_SUFFIXES += ("_up.weight", "_down.weight", "_shexp.weight")
LINEAR_SUFFIXES += ("ssm_out.weight", "ssm_alpha.weight", "ssm_beta.weight")  # qwen35
LINEAR_SUFFIXES += (".proj.weight",)  # gemma4's per-layer input product (inp_gate: _gate)


def estimate_weight_bytes(gguf_file: GGUFFile, backend: Backend) -> int:
    """Bytes the model's weights would take on `backend`, from the tensor table (and the
    head's first rows), without loading: what `llmq models` shows."""
    total = 0
    tied = not gguf_file.has_tensor("output.weight")
    for name in gguf_file.tensor_names():
        if name == "token_embd.weight":
            total += backend.stored_bytes(gguf_file, name, "embedding")
            if tied:
                total += backend.stored_bytes(gguf_file, name, "tied head")
        elif name == "output.weight":
            total += backend.stored_bytes(gguf_file, name, "head")
        elif name == "per_layer_token_embd.weight":  # Gemma 4 E2B/E4B: rows read as used
            total += backend.stored_bytes(gguf_file, name, "embedding")
        elif name == "per_layer_model_proj.weight":
            total += backend.stored_bytes(gguf_file, name, "linear")
        elif name.startswith("blk.") and name.endswith("_exps.weight"):  # [E, out, in]
            experts = gguf_file.blocks(name)[2][0]
            total += experts * backend.stored_bytes(gguf_file, expert_tensor(name, 0), "linear")
        elif name.startswith("blk.") and name.endswith(LINEAR_SUFFIXES):
            total += backend.stored_bytes(gguf_file, name, "linear")
        else:
            total += backend.stored_bytes(gguf_file, name, "vector")
    return total
