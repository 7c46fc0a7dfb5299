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
