"""Offline batches end to end: the official `openai` client against the API on a real HTTP
server, real `llmq worker` processes serving a tiny model, real Redis (db 11, flushed
before and after each test). Includes RELIABILITY F13 at a small scale: a worker's whole
process tree is killed half-way and every valid line is still answered exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from werkzeug.serving import make_server

from api.app import create_app
from tests.tiny_models import write_tiny_llama
from tests.workers.conftest import REPO, WorkerProcess, wait_for
from workers import keys

pytestmark = pytest.mark.integration

REDIS_URL = os.environ.get("LLMQ_BATCH_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
MODEL = "tiny-batch"
TOKENS = 8  # every line generates exactly this many tokens (ignore_eos)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / f"{MODEL}.gguf")


@pytest.fixture
def conn() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip(f"no Redis at {REDIS_URL}")
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


@pytest.fixture
def server(conn: redis.Redis) -> Iterator[str]:
    app = create_app({"TESTING": True, "REDIS_URL": REDIS_URL})
    httpd = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)
    app.extensions["redis"].close()


@pytest.fixture
def workers(conn: redis.Redis, model_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(name: str, step_delay_ms: int = 0) -> WorkerProcess:
        proc = WorkerProcess(
            name, [str(model_path)], step_delay_ms=step_delay_ms, redis_url=REDIS_URL
        )
        started.append(proc)
        proc.wait_registered(conn)
        wait_for(lambda: conn.hexists(keys.MODELS, MODEL), 20, "the model to be published")
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def oai(server: str) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=30)
    yield client
    client.close()


def write_input(path: Path, count: int, invalid_every: int = 0) -> tuple[set[str], set[str]]:
    """`count` lines; every `invalid_every`-th is broken (alternately bad JSON and an
    unknown model). Returns (valid custom_ids, invalid custom_ids or "" for no id)."""
    valid, invalid, lines = set(), set(), []
    for i in range(count):
        custom_id = f"req-{i}"
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"say {i}"}],
            "max_tokens": TOKENS,
            "ignore_eos": True,
            "temperature": 0,
        }
        item = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions"}
        if invalid_every and i % invalid_every == invalid_every - 1:
            if (i // invalid_every) % 2:
                lines.append('{"custom_id": "' + custom_id + '", broken')
                invalid.add("")
            else:
                lines.append(json.dumps({**item, "body": {**body, "model": "no-such-model"}}))
                invalid.add(custom_id)
            continue
        lines.append(json.dumps({**item, "body": body}))
        valid.add(custom_id)
    path.write_text("\n".join(lines) + "\n")
    return valid, invalid


def wait_status(
    oai: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float, until: Any = None
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = oai.batches.retrieve(batch_id)
        if batch.status in statuses or (until is not None and until(batch)):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.1)


def lines_of(oai: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in oai.files.content(file_id).text.splitlines()]


def test_openai_client_runs_a_batch_with_invalid_lines(oai, workers, tmp_path) -> None:
    workers("batch-w1")
    valid, invalid = write_input(tmp_path / "in.jsonl", 30, invalid_every=10)
    with open(tmp_path / "in.jsonl", "rb") as handle:
        uploaded = oai.files.create(file=handle, purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == (tmp_path / "in.jsonl").stat().st_size
    batch = oai.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"suite": "e2e"},
    )
    assert batch.status == "validating" and batch.request_counts.failed == 3
    batch = wait_status(oai, batch.id, {"completed", "failed"}, 60)
    assert batch.status == "completed" and batch.completed_at >= batch.in_progress_at
    assert (batch.request_counts.completed, batch.request_counts.failed) == (27, 3)
    output = lines_of(oai, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(valid)
    for item in output:
        body = item["response"]["body"]
        assert item["response"]["status_code"] == 200 and item["error"] is None
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == TOKENS
    errors = lines_of(oai, batch.error_file_id)
    assert {e["custom_id"] or "" for e in errors} == invalid
    assert {e["error"]["code"] for e in errors} == {"invalid_json_line", "model_not_found"}
    assert batch.id in [b.id for b in oai.batches.list(limit=5)]
    assert batch.metadata == {"suite": "e2e"}
    assert batch.usage.output_tokens == 27 * TOKENS


def test_cancel_midway_gives_partial_output(oai, workers, tmp_path) -> None:
    workers("batch-w1", step_delay_ms=40)
    valid, _ = write_input(tmp_path / "in.jsonl", 48)
    with open(tmp_path / "in.jsonl", "rb") as handle:
        file_id = oai.files.create(file=handle, purpose="batch").id
    batch = oai.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_status(oai, batch.id, set(), 60, until=lambda b: b.request_counts.completed >= 8)
    assert oai.batches.cancel(batch.id).status == "cancelling"
    batch = wait_status(oai, batch.id, {"cancelled"}, 30)
    counts = batch.request_counts
    assert 8 <= counts.completed < 48 and counts.completed + counts.failed == 48
    output = lines_of(oai, batch.output_file_id)
    errors = lines_of(oai, batch.error_file_id)
    assert len(output) == counts.completed
    answered = [o["custom_id"] for o in output] + [e["custom_id"] for e in errors]
    assert sorted(answered) == sorted(valid)  # every line exactly once
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


def test_worker_killed_halfway_every_valid_line_exactly_once(oai, workers, conn, tmp_path) -> None:
    """RELIABILITY F13, smaller: 200 lines, 2% invalid, kill -9 a worker's tree at 50%."""
    doomed = workers("batch-doomed", step_delay_ms=30)
    survivor = workers("batch-survivor", step_delay_ms=30)
    valid, invalid = write_input(tmp_path / "in.jsonl", 200, invalid_every=50)
    with open(tmp_path / "in.jsonl", "rb") as handle:
        file_id = oai.files.create(file=handle, purpose="batch").id
    batch = oai.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_status(oai, batch.id, set(), 60, until=lambda b: b.request_counts.completed >= 98)
    doomed.kill_tree()
    batch = wait_status(oai, batch.id, {"completed", "failed"}, 90)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (196, 4)
    output = lines_of(oai, batch.output_file_id)
    custom_ids = [o["custom_id"] for o in output]
    assert len(custom_ids) == len(set(custom_ids)) == 196 and set(custom_ids) == valid
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == TOKENS for o in output)
    assert {e["custom_id"] or "" for e in lines_of(oai, batch.error_file_id)} == invalid
    # nothing was generated twice: resumed jobs continued from their streams
    generated = int(conn.hget(keys.METRIC_TOKENS_GENERATED, MODEL) or 0)
    assert 196 * TOKENS - 64 <= generated <= 196 * TOKENS
    assert int(conn.hget(keys.METRIC_JOBS, "finished") or 0) <= 196
    assert f"requeued abandoned job {batch.id}-" in survivor.output()  # the kill hit jobs


def test_llmq_batch_submit_wait_writes_results(server, workers, tmp_path) -> None:
    workers("batch-w1")
    valid, invalid = write_input(tmp_path / "in.jsonl", 10, invalid_every=5)
    out = tmp_path / "out.jsonl"
    cli = [sys.executable, "-m", "workers.cli", "batch"]
    env = {**os.environ, "LLMQ_BASE_URL": server}
    done = subprocess.run(
        [*cli, "submit", str(tmp_path / "in.jsonl"), "--wait", "--poll", "0.2", "-o", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    batch_id = done.stdout.strip()
    assert batch_id.startswith("batch_")
    assert "8/10 requests" in done.stderr or "10/10 requests" in done.stderr
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == sorted(valid)
    errors = (tmp_path / "out.errors.jsonl").read_text().splitlines()
    assert {json.loads(x)["custom_id"] or "" for x in errors} == invalid
    status = subprocess.run(
        [*cli, "status", batch_id], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
    )
    assert json.loads(status.stdout)["status"] == "completed"
    results = subprocess.run(
        [*cli, "results", batch_id], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
    )
    assert results.returncode == 0 and len(results.stdout.splitlines()) == len(valid)
    assert len([x for x in results.stderr.splitlines() if x.startswith("{")]) == len(invalid)
    missing = subprocess.run(
        [*cli, "status", "batch_nope"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert missing.returncode == 1 and "404" in missing.stderr
