"""`POST /admin/loras` answers once the adapter is usable, through real HTTP, real Redis and
a real `llmq worker` process (`api.lora_rollout`): a client that registers an adapter and at
once names it in a request gets the adapter's completion, never a 404; an adapter every
worker fails to load is refused and not registered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from runtime.engine import Engine
from runtime.gguf_file import GGUFFile
from runtime.registry import ModelSpec
from runtime.sampling import SamplingParams
from tests.tiny_models import write_lora, write_tiny_llama
from tests.workers.conftest import WorkerProcess, wait_for

pytestmark = pytest.mark.integration

TINY = "tiny-llama"  # the model id of the tiny model file (its stem)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_llama(tmp_path / f"{TINY}.gguf")


@pytest.fixture
def folders(tmp_path: Path, tiny: Path, monkeypatch) -> tuple[Path, Path]:
    """The API's LLMQ_ADAPTER_DIR and the worker's: both hold `style.gguf`; only the API's
    holds `only-here.gguf` (a worker on a machine whose folder lacks a file)."""
    api_dir, worker_dir = tmp_path / "api-adapters", tmp_path / "worker-adapters"
    for folder in (api_dir, worker_dir):
        folder.mkdir()
        write_lora(folder / "style.gguf", tiny, seed=3)
    write_lora(api_dir / "only-here.gguf", tiny, seed=4)
    monkeypatch.setenv("LLMQ_ADAPTER_DIR", str(worker_dir))
    return api_dir, worker_dir


@pytest.fixture
def worker(
    redis_url: str, real_redis: redis.Redis, tiny: Path, folders, monkeypatch
) -> Iterator[WorkerProcess]:
    process = WorkerProcess("lora-w1", [str(tiny)], redis_url=redis_url)
    monkeypatch.setenv("LLMQ_ADAPTER_DIR", str(folders[0]))  # the API's, from now on
    yield process
    process.stop()


def _expected(tiny: Path, adapter: Path, prompt: str, max_tokens: int) -> str:
    engine = Engine(ModelSpec(TINY, str(tiny), lambda: tiny), GGUFFile(tiny))
    engine.load_adapter("style", adapter)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [e.token_id for e in engine.generate(engine.encode(prompt), params, [("style", 1.0)])]
    return engine.tokenizer.decode(ids)


def _ready(server: str, worker: WorkerProcess) -> None:
    def loaded() -> bool:
        worker.assert_alive()
        models = httpx.get(f"{server}/admin/models").json()["data"]
        return any(p.get("state") == "ready" for m in models for p in m["pools"].values())

    wait_for(loaded, 60, "the tiny model loaded")


def test_an_adapter_is_usable_as_soon_as_its_registration_answers(
    server: str, worker: WorkerProcess, tiny: Path, folders
) -> None:
    _ready(server, worker)
    registered = httpx.post(
        f"{server}/admin/loras",
        json={"name": "style", "path": str(folders[0] / "style.gguf"), "base_model": TINY},
        timeout=30,
    )
    assert registered.status_code == 201, registered.text
    body = registered.json()
    assert body["state"] == "ready" and body["path"] == "style.gguf"
    assert body["workers"][worker.name]["state"] == "ready"
    request = {"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    answer = httpx.post(f"{server}/v1/completions", json={**request, "model": "style"}, timeout=30)
    assert answer.status_code == 200, answer.text
    expected = _expected(tiny, folders[1] / "style.gguf", "hello", 6)
    assert answer.json()["choices"][0]["text"] == expected
    plain = httpx.post(f"{server}/v1/completions", json={**request, "model": TINY}, timeout=30)
    assert plain.json()["choices"][0]["text"] != expected  # the adapter made the difference


def test_an_adapter_no_worker_can_load_is_refused_and_not_registered(
    server: str, worker: WorkerProcess, folders
) -> None:
    _ready(server, worker)
    refused = httpx.post(
        f"{server}/admin/loras",
        json={"name": "lost", "path": "only-here.gguf", "base_model": TINY},
        timeout=30,
    )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "path"
    assert f"worker {worker.name}: no adapter file 'only-here.gguf'" in error["message"]
    assert httpx.get(f"{server}/admin/loras").json()["data"] == []
    answer = httpx.post(
        f"{server}/v1/completions", json={"model": "lost", "prompt": "hi", "max_tokens": 2}
    )
    assert answer.status_code == 404  # never registered: an unknown model, as before
