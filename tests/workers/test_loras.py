"""LoRA adapters on a worker, against real Redis: adapters registered in `keys.LORAS` load
on the engines of their base model and show in the pool; a job's `lora` runs with them;
an adapter the worker lacks fails the job with a 404; a removed adapter is unloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.engine import Engine
from runtime.gguf_file import GGUFFile
from runtime.registry import ModelSpec
from runtime.sampling import SamplingParams
from tests.tiny_models import write_lora
from tests.workers.conftest import TINY, submit, tokens, wait_done, wait_for
from workers import keys
from workers.wire import loras
from workers.wire.job import COMPLETIONS, FAILED, FINISHED
from workers.wire.worker_info import WorkerInfo

pytestmark = pytest.mark.integration

GREEDY = {"model": TINY, "temperature": 0, "ignore_eos": True, "max_tokens": 6}


@pytest.fixture
def adapter_dir(tmp_path: Path, tiny_model: Path, monkeypatch) -> Path:
    folder = tmp_path / "adapters"
    folder.mkdir()
    write_lora(folder / "style.gguf", tiny_model, seed=3)
    monkeypatch.setenv("LLMQ_ADAPTER_DIR", str(folder))
    return folder


def register(conn, name: str, path: str, base: str = TINY) -> None:
    loras.register(conn, name, path, base)


def expected_tokens(tiny_model: Path, adapter: Path | None, prompt: str) -> list[int]:
    engine = Engine(ModelSpec(TINY, str(tiny_model), lambda: tiny_model), GGUFFile(tiny_model))
    lora = []
    if adapter is not None:
        engine.load_adapter("style", adapter)
        lora = [("style", 1.0)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    return [e.token_id for e in engine.generate(engine.encode(prompt), params, lora)]


def test_a_job_runs_with_its_registered_adapter(conn, start_worker, tiny_model, adapter_dir):
    register(conn, "style", "style.gguf")
    worker = start_worker()
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "hello", "lora": [{"name": "style"}]})
    assert wait_done(conn, job_id).status == FINISHED
    plain = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "hello"})
    assert wait_done(conn, plain).status == FINISHED
    with_adapter = expected_tokens(tiny_model, adapter_dir / "style.gguf", "hello")
    assert with_adapter != expected_tokens(tiny_model, None, "hello")
    texts = "".join(t["text"] for t in tokens(conn, job_id))
    engine = Engine(ModelSpec(TINY, str(tiny_model), lambda: tiny_model), GGUFFile(tiny_model))
    assert texts == engine.tokenizer.decode(with_adapter)

    def pool() -> dict:
        raw = conn.hgetall(keys.worker(worker.name))
        return WorkerInfo.from_hash(raw).pool.get(TINY, {}) if raw else {}

    wait_for(lambda: pool().get("loras", {}).get("style", {}).get("state") == "ready")
    loras.unregister(conn, "style")
    wait_for(lambda: "style" not in pool().get("loras", {}), timeout=15, what="unloaded")
    again = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "hello", "lora": [{"name": "style"}]})
    failed = wait_done(conn, again)
    assert failed.status == FAILED and failed.error["status"] == 404


def test_an_unknown_adapter_fails_the_job_with_a_404(conn, start_worker, adapter_dir):
    start_worker()
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "x", "lora": [{"name": "nope"}]})
    failed = wait_done(conn, job_id)
    assert failed.status == FAILED and failed.error["status"] == 404
    assert failed.error["error"]["code"] == "adapter_not_found"
    assert failed.error["error"]["param"] == "lora"


def test_an_adapter_that_does_not_fit_is_reported_failed(conn, start_worker, adapter_dir):
    (adapter_dir / "bad.gguf").write_bytes(b"GGUF not really")
    register(conn, "bad", "bad.gguf")
    worker = start_worker()

    def state() -> dict:
        raw = conn.hgetall(keys.worker(worker.name))
        pool = WorkerInfo.from_hash(raw).pool if raw else {}
        return pool.get(TINY, {}).get("loras", {}).get("bad", {})

    failed = wait_for(lambda: state().get("state") == "failed" and state(), timeout=15)
    assert "bad.gguf" in failed["error"]
