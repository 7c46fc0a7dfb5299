"""LoRA adapters on a worker, against real Redis: adapters registered in `keys.LORAS` load
on the engines of their base model and show in the pool, at the heartbeat or at once on the
`adapters` command; a job's `lora` runs with them, one registered since the last heartbeat
too (loaded before the job is planned); an adapter the worker lacks fails the job with a
404; a removed adapter is unloaded."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from runtime.engine import Engine
from runtime.gguf_file import GGUFFile
from runtime.registry import ModelSpec
from runtime.sampling import SamplingParams
from tests.tiny_models import write_lora
from tests.workers.conftest import TINY, submit, tokens, wait_done, wait_for
from workers import keys
from workers import worker as worker_module
from workers.wire import loras
from workers.wire.commands import push_command
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


def expected_tokens(
    tiny_model: Path, adapter: Path | None, prompt: str, logprobs: int | None = None
) -> list[int]:
    """The engine's own greedy tokens; `logprobs` as the job asks, since a row that reports
    logprobs takes the file's own head (runtime/kernels/heads.py), whose argmax may differ
    from the fast head's at a near-tie."""
    engine = Engine(ModelSpec(TINY, str(tiny_model), lambda: tiny_model), GGUFFile(tiny_model))
    lora = []
    if adapter is not None:
        engine.load_adapter("style", adapter)
        lora = [("style", 1.0)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=logprobs)
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


def _lora_states(conn, worker_name: str) -> dict:
    raw = conn.hgetall(keys.worker(worker_name))
    pool = WorkerInfo.from_hash(raw).pool if raw else {}
    return pool.get(TINY, {}).get("loras", {})


@pytest.fixture
def slow_heartbeat(monkeypatch) -> None:
    """Adapter syncs only at start-up: what loads later loads because of a command or a job."""
    monkeypatch.setattr(worker_module, "WORKER_HEARTBEAT_SECONDS", 120)


def test_the_adapters_command_loads_a_registration_at_once(
    conn, start_worker, adapter_dir, slow_heartbeat
):
    worker = start_worker()
    wait_for(lambda: worker.pool.snapshot().get(TINY, {}).get("state") == "ready", what="load")
    entry = loras.register(conn, "style", "style.gguf", TINY)
    time.sleep(0.5)
    assert "style" not in _lora_states(conn, worker.name)  # no heartbeat sync meanwhile
    with conn.pipeline() as pipe:
        push_command(pipe, worker.name, "adapters", TINY)
        pipe.execute()
    state = wait_for(lambda: _lora_states(conn, worker.name).get("style"), 5, "loaded")
    assert state["state"] == "ready" and state["registered_at"] == entry["registered_at"]
    loras.unregister(conn, "style")
    with conn.pipeline() as pipe:
        push_command(pipe, worker.name, "adapters", TINY)
        pipe.execute()
    wait_for(lambda: "style" not in _lora_states(conn, worker.name), 5, "unloaded")


def test_a_registration_that_failed_is_retried_when_registered_again(
    conn, start_worker, adapter_dir, slow_heartbeat
):
    worker = start_worker()
    wait_for(lambda: worker.pool.snapshot().get(TINY, {}).get("state") == "ready", what="load")
    (adapter_dir / "late.gguf").write_bytes(b"GGUF not yet")
    for expected in ("failed", "ready"):
        if expected == "ready":  # the right file arrives; the same path is registered again
            (adapter_dir / "late.gguf").write_bytes((adapter_dir / "style.gguf").read_bytes())
        entry = loras.register(conn, "late", "late.gguf", TINY)
        with conn.pipeline() as pipe:
            push_command(pipe, worker.name, "adapters", TINY)
            pipe.execute()

        def settled(entry=entry):
            state = _lora_states(conn, worker.name).get("late", {})
            return state if state.get("registered_at") == entry["registered_at"] else None

        assert wait_for(settled, 5, expected)["state"] == expected


def test_a_job_naming_an_adapter_registered_since_the_heartbeat_runs(
    conn, start_worker, tiny_model, adapter_dir, slow_heartbeat
):
    worker = start_worker()
    wait_for(lambda: worker.pool.snapshot().get(TINY, {}).get("state") == "ready", what="load")
    register(conn, "style", "style.gguf")
    # echo with logprobs scores the prompt with the adapter while the job is planned
    body = {**GREEDY, "prompt": "hello", "lora": [{"name": "style"}], "echo": True}
    job_id = submit(conn, COMPLETIONS, {**body, "logprobs": 1})
    done = wait_done(conn, job_id)
    assert done.status == FINISHED, done.error
    texts = "".join(t["text"] for t in tokens(conn, job_id))
    engine = Engine(ModelSpec(TINY, str(tiny_model), lambda: tiny_model), GGUFFile(tiny_model))
    with_adapter = expected_tokens(tiny_model, adapter_dir / "style.gguf", "hello", logprobs=1)
    assert texts == engine.tokenizer.decode(with_adapter)
