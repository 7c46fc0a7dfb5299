"""LoRA adapters through real HTTP, real Redis and a real `llmq worker` process.

`POST /admin/loras` answers once the adapter is usable (`api.lora_rollout`): a client that
registers an adapter and at once names it in a request gets the adapter's completion, never
a 404; an adapter every worker fails to load is refused and not registered. A request whose
`model` names an adapter is answered in the adapter's name, as vLLM does: the body, every
stream chunk, the async job and its result, and a batch's output lines."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
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


def _register(server: str, worker: WorkerProcess, name: str, path: str) -> httpx.Response:
    """POST /admin/loras for an adapter of the tiny model, once the worker holds it."""
    _ready(server, worker)
    body = {"name": name, "path": path, "base_model": TINY}
    return httpx.post(f"{server}/admin/loras", json=body, timeout=30)


def test_an_adapter_is_usable_as_soon_as_its_registration_answers(
    server: str, worker: WorkerProcess, tiny: Path, folders
) -> None:
    registered = _register(server, worker, "style", str(folders[0] / "style.gguf"))
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
    refused = _register(server, worker, "lost", "only-here.gguf")
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "path"
    assert f"worker {worker.name}: no adapter file 'only-here.gguf'" in error["message"]
    assert httpx.get(f"{server}/admin/loras").json()["data"] == []
    answer = httpx.post(
        f"{server}/v1/completions", json={"model": "lost", "prompt": "hi", "max_tokens": 2}
    )
    assert answer.status_code == 404  # never registered: an unknown model, as before


def test_a_model_naming_an_adapter_is_answered_in_the_adapters_name(
    server: str, worker: WorkerProcess, tiny: Path, folders
) -> None:
    registered = _register(server, worker, "style", "style.gguf")
    assert registered.status_code == 201, registered.text
    expected = _expected(tiny, folders[1] / "style.gguf", "hello", 4)
    args = dict(model="style", prompt="hello", max_tokens=4, temperature=0)
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=30)
    with client:
        sync = client.completions.create(**args, extra_body={"ignore_eos": True})
        assert (sync.model, sync.choices[0].text) == ("style", expected)
        chunks = list(client.completions.create(**args, stream=True))
        assert {c.model for c in chunks} == {"style"}
        chat = client.chat.completions.create(
            model="style", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.model == "style"
        named = client.completions.create(
            **{**args, "model": TINY}, extra_body={"lora": [{"name": "style"}]}
        )
        assert named.model == TINY  # the base model named, an adapter in `lora`: the base

        lines = [
            {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": body}
            for i, body in enumerate([{**args, "ignore_eos": True}, {**args, "model": TINY}])
        ]
        data = "\n".join(json.dumps(line) for line in lines).encode()
        upload = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 60
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.2)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        output = client.files.content(batch.output_file_id).text.splitlines()
    bodies = {o["custom_id"]: o["response"]["body"] for o in map(json.loads, output)}
    assert bodies["c0"]["model"] == "style" and bodies["c0"]["choices"][0]["text"] == expected
    assert bodies["c1"]["model"] == TINY

    job = httpx.post(
        f"{server}/v1/completions", json=args, headers={"Prefer": "respond-async"}, timeout=30
    )
    assert job.status_code == 202, job.text

    def finished() -> dict | None:
        view = httpx.get(f"{server}/v1/jobs/{job.json()['id']}").json()
        return view if view["status"] == "finished" else None

    view = wait_for(finished, 30, "the async job")
    assert view["model"] == "style" and view["result"]["model"] == "style"
