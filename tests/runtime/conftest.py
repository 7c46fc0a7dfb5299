"""Tiny GGUF models shared by the runtime unit tests (written once per session)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.engine import EngineConfig
from tests.runtime.generation_helpers import named_engine, same_kernels
from tests.tiny_models import TinyShape, write_tiny_gemma3, write_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_gemma3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny") / "tiny-gemma3.gguf")


# the tensor path's tiny models: a context of 1024 gives three table widths (256, 512, 1024
# positions); gemma3's window of 40 positions spans 2 to 4 blocks
LONG = TinyShape(context_length=1024)
LONG_GEMMA = TinyShape(n_layers=6, head_dim=32, context_length=1024, sliding_window=40)


@pytest.fixture(scope="session")
def long_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("long")
    return {
        "llama": write_tiny_llama(d / "long-llama.gguf", LONG),
        "gemma3": write_tiny_gemma3(d / "long-gemma3.gguf", LONG_GEMMA),
    }


@pytest.fixture(scope="session", params=["llama", "gemma3"])
def tiny_model_path(request, tiny_llama_path: Path, tiny_gemma3_path: Path) -> Path:
    return tiny_llama_path if request.param == "llama" else tiny_gemma3_path


def _invariant_kernels():
    """Kernels whose rows do not depend on their batch (`row_invariant_plan`)."""
    from runtime.kernels.cpu import cpu_features, row_invariant_plan

    return row_invariant_plan(cpu_features())


# the real models (tests/conftest.py gives `{model}_gguf_path`), and the kernels an engine
# may name: None (the ones measured best on this CPU), "same" (`same_kernels()`: fbgemm's
# fp16 for every weight, the host and tensor paths then comparable) or "invariant"
MODEL_IDS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma-3-270m"}
KERNELS = {"same": same_kernels, "invariant": _invariant_kernels}

# The engines the runtime tests share, each loaded once a session on first use:
# fixture -> (model, backend, kernels, EngineConfig's other fields)
ENGINES: dict[str, tuple[str, str, str | None, dict[str, Any]]] = {
    # the exact numpy backend
    "smollm2_engine": ("smollm2", "numpy", None, {}),
    "gemma3_engine": ("gemma3", "numpy", None, {}),
    # quantized weights, torch's CPU kernels
    "smollm2_torch_engine": ("smollm2", "torch", None, {}),
    "gemma3_torch_engine": ("gemma3", "torch", None, {}),
    "smollm2_fp16_engine": ("smollm2", "torch", "same", {}),
    # the tensor forward pass (a GPU worker's code) on the CPU
    "smollm2_tensor_engine": ("smollm2", "torch", None, {"torch_forward": True}),
    "gemma3_tensor_engine": ("gemma3", "torch", None, {"torch_forward": True}),
    "smollm2_fp16_tensor_engine": ("smollm2", "torch", "same", {"torch_forward": True}),
    # the first GPU (tests using these are marked `gpu`)
    "smollm2_cuda_engine": ("smollm2", "torch", None, {"device": "cuda:0"}),
    "gemma3_cuda_engine": ("gemma3", "torch", None, {"device": "cuda:0"}),
    "smollm2_invariant_engine": ("smollm2", "torch", "invariant", {}),
    "gemma3_invariant_engine": ("gemma3", "torch", "invariant", {}),
}


def _engine_fixture(name: str, model: str, backend: str, kernels: str | None, config: dict):
    """A session fixture `name`: `model`'s engine as ENGINES describes it."""

    def engine(request: pytest.FixtureRequest):
        path = request.getfixturevalue(f"{model}_gguf_path")
        chosen = {} if kernels is None else {"kernels": KERNELS[kernels]()}
        return named_engine(
            MODEL_IDS[model], path, EngineConfig(backend=backend, **config, **chosen)
        )

    engine.__doc__ = f"{MODEL_IDS[model]} on {backend}, kernels {kernels}, {config or 'defaults'}"
    return pytest.fixture(scope="session", name=name)(engine)


for _name, _engine_args in ENGINES.items():
    globals()[_name] = _engine_fixture(_name, *_engine_args)
