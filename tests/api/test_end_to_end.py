"""API and the real worker together: an `LLMQWorker` (in a thread) serving a tiny random
llama GGUF, the app on a real HTTP server, and the official `openai` client."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import hang_up_after, worker_thread
from tests.api.sse import parse
from workers import keys

pytestmark = pytest.mark.integration

MODEL = "tiny-llama-e2e"


@pytest.fixture
def real_worker(redis_url: str, real_redis, tiny_model: Path) -> Iterator[object]:
    # ~100 tokens/s, so a long generation is still running when cut
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    with worker_thread(redis_url, real_redis, tiny_model, name, step_delay=0.01) as worker:
        yield worker


def test_sync_and_stream_agree(oai, real_worker) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    sync = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert sync.usage.completion_tokens <= 6 and sync.usage.prompt_tokens > 0
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == sync.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == sync.usage.completion_tokens


def test_completion_with_logprobs_and_embeddings(oai, real_worker) -> None:
    completion = oai.completions.create(
        model=MODEL, prompt="abc", max_tokens=3, temperature=0, logprobs=2
    )
    assert len(completion.choices[0].logprobs.tokens) == completion.usage.completion_tokens
    embedding = oai.embeddings.create(model=MODEL, input=["a", "bc"])
    vector = embedding.data[1].embedding
    assert abs(sum(x * x for x in vector) - 1.0) < 1e-3


def test_async_job_events_resume(server, real_worker) -> None:
    job = httpx.post(
        f"{server}/v1/completions",
        headers={"Prefer": "respond-async"},
        json={
            "model": MODEL,
            "prompt": "abc",
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
        },
    ).json()
    url = f"{server}/v1/jobs/{job['id']}/events"
    whole = list(parse(httpx.get(url, timeout=30).text.split("\n")))
    assert whole[-1].event == "done"
    tokens = [m for m in whole if m.event == "token"]
    assert [m.json()["index"] for m in tokens] == list(range(12))
    resumed = list(parse(httpx.get(url, headers={"Last-Event-ID": tokens[4].id}).text.split("\n")))
    assert [m.json()["index"] for m in resumed if m.event == "token"] == list(range(5, 12))
    view = httpx.get(f"{server}/v1/jobs/{job['id']}").json()
    assert view["status"] == "finished"
    assert view["result"]["choices"][0]["text"] == "".join(m.json()["text"] for m in tokens)


def test_stream_disconnect_cancels_real_job(server, real_worker, real_redis) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 240, "ignore_eos": True, "stream": True}
    hang_up_after(server, body)
    ids = [k.decode().split(":")[2] for k in real_redis.keys(keys.job("*")) if k.count(b":") == 2]
    assert len(ids) == 1
    deadline = time.monotonic() + 5
    while real_redis.hget(keys.job(ids[0]), "status") != b"cancelled":
        assert time.monotonic() < deadline, "the real worker did not stop the job"
        time.sleep(0.05)
    assert real_redis.xlen(keys.job_events(ids[0])) < 200


def test_ops_and_admin_see_the_worker(server, real_worker) -> None:
    assert httpx.get(f"{server}/ready").json()["models"] == [MODEL]
    models = {m["id"]: m for m in httpx.get(f"{server}/admin/models").json()["data"]}
    assert models[MODEL]["serving"] == [real_worker.name]
    worker = httpx.get(f"{server}/admin/workers").json()["data"][0]
    assert worker["alive"] is True
    assert worker["loop"]["seconds"] > 0  # workers/loop_clock.py, with each heartbeat
    assert "llmq_workers_live 1.0" in httpx.get(f"{server}/metrics").text
