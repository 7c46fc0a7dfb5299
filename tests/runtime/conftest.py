"""Tiny GGUF models shared by the runtime unit tests (written once per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiny_models import write_tiny_gemma3, write_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


@pytest.fixture(scope="session")
def tiny_gemma3_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny") / "tiny-gemma3.gguf")


@pytest.fixture(scope="session", params=["llama", "gemma3"])
def tiny_model_path(request, tiny_llama_path: Path, tiny_gemma3_path: Path) -> Path:
    return tiny_llama_path if request.param == "llama" else tiny_gemma3_path


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_gguf_path: Path):
    """The real SmolLM2 engine, loaded once for every test that needs it."""
    from runtime.engine import Engine
    from runtime.gguf_file import GGUFFile
    from runtime.registry import resolve

    return Engine(resolve("smollm2-135m-instruct"), GGUFFile(smollm2_gguf_path))


@pytest.fixture(scope="session")
def gemma3_engine(gemma3_gguf_path: Path):
    from runtime.engine import Engine
    from runtime.gguf_file import GGUFFile
    from runtime.registry import ModelSpec

    spec = ModelSpec("gemma-3-270m", str(gemma3_gguf_path), lambda: gemma3_gguf_path)
    return Engine(spec, GGUFFile(gemma3_gguf_path))
