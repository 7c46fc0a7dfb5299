"""Tiny GGUF models shared by the runtime unit tests (written once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.generation_helpers import same_kernels
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


def _engine(model_id: str, path: Path, backend: str, **config):
    from runtime.engine import Engine, EngineConfig
    from runtime.gguf_file import GGUFFile
    from runtime.registry import ModelSpec

    spec = ModelSpec(model_id, str(path), lambda: path)
    return Engine(spec, GGUFFile(path), EngineConfig(backend=backend, **config))


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_gguf_path: Path):
    """The real SmolLM2 engine on the exact numpy backend, loaded once for every test."""
    return _engine("smollm2-135m-instruct", smollm2_gguf_path, "numpy")


@pytest.fixture(scope="session")
def gemma3_engine(gemma3_gguf_path: Path):
    return _engine("gemma-3-270m", gemma3_gguf_path, "numpy")


@pytest.fixture(scope="session")
def smollm2_torch_engine(smollm2_gguf_path: Path):
    """SmolLM2 on the torch backend (quantized weights, torch's CPU kernels)."""
    return _engine("smollm2-135m-instruct", smollm2_gguf_path, "torch")


@pytest.fixture(scope="session")
def gemma3_torch_engine(gemma3_gguf_path: Path):
    return _engine("gemma-3-270m", gemma3_gguf_path, "torch")


@pytest.fixture(scope="session")
def smollm2_fp16_engine(smollm2_gguf_path: Path):
    """SmolLM2 on the host torch path with `same_kernels()`."""
    return _engine("smollm2-135m-instruct", smollm2_gguf_path, "torch", kernels=same_kernels())


@pytest.fixture(scope="session")
def smollm2_fp16_tensor_engine(smollm2_gguf_path: Path):
    """SmolLM2 on the tensor forward pass (on the CPU) with `same_kernels()`."""
    return _engine(
        "smollm2-135m-instruct",
        smollm2_gguf_path,
        "torch",
        torch_forward=True,
        kernels=same_kernels(),
    )


@pytest.fixture(scope="session")
def smollm2_tensor_engine(smollm2_gguf_path: Path):
    """SmolLM2 on the tensor forward pass (a GPU worker's code) run on the CPU."""
    return _engine("smollm2-135m-instruct", smollm2_gguf_path, "torch", torch_forward=True)


@pytest.fixture(scope="session")
def gemma3_tensor_engine(gemma3_gguf_path: Path):
    return _engine("gemma-3-270m", gemma3_gguf_path, "torch", torch_forward=True)


@pytest.fixture(scope="session")
def smollm2_cuda_engine(smollm2_gguf_path: Path):
    """SmolLM2 on the first GPU (tests using it are marked `gpu`)."""
    return _engine("smollm2-135m-instruct", smollm2_gguf_path, "torch", device="cuda:0")


@pytest.fixture(scope="session")
def gemma3_cuda_engine(gemma3_gguf_path: Path):
    return _engine("gemma-3-270m", gemma3_gguf_path, "torch", device="cuda:0")


def _invariant_engine(model_id: str, path: Path):
    """`model_id` on kernels whose rows do not depend on their batch (`row_invariant_plan`)."""
    from runtime.kernels.cpu import cpu_features, row_invariant_plan

    return _engine(model_id, path, "torch", kernels=row_invariant_plan(cpu_features()))


@pytest.fixture(scope="session")
def smollm2_invariant_engine(smollm2_gguf_path: Path):
    return _invariant_engine("smollm2-135m-instruct", smollm2_gguf_path)


@pytest.fixture(scope="session")
def gemma3_invariant_engine(gemma3_gguf_path: Path):
    return _invariant_engine("gemma-3-270m", gemma3_gguf_path)
