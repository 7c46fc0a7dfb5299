"""The job system end to end on real Redis (db 13), with a fake worker thread that follows
workers.wire: sync, streaming, async jobs, events with resume, cancellation,
disconnects, backpressure and idempotency."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx
import pytest

from api.app import create_app
from tests.api.sse import parse, parse_text
from workers import keys

pytestmark = pytest.mark.integration

ASYNC = {"Prefer": "respond-async"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def completion(prompt: str = "hello", **fields) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 3, **fields}


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def job_records(conn) -> list[bytes]:
    return [k for k in conn.keys(keys.job("*")) if k.count(b":") == 2]


def status_of(conn, job_id: str) -> str | None:
    raw = conn.hget(keys.job(job_id), "status")
    return raw.decode() if raw else None


# ---------------------------------------------------------------- synchronous


def test_sync_completion(live_client, worker) -> None:
    response = live_client.post("/v1/completions", json=completion())
    assert response.status_code == 200
    body = response.get_json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == "t0 t1 t2 "
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    assert body["id"].startswith("cmpl-")


def test_sync_chat(live_client, worker) -> None:
    response = live_client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200
    body = response.get_json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "t0 t1 t2 "}


def test_sync_embeddings(live_client, worker) -> None:
    response = live_client.post("/v1/embeddings", json={"model": "tiny", "input": ["a", "b"]})
    assert response.status_code == 200
    body = response.get_json()
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize(("prompt", "status"), [("toolong", 400), ("crash", 500)])
def test_worker_error_becomes_the_response(live_client, worker, prompt, status) -> None:
    """Rows 11-12: the worker's context check surfaces as a 400 in OpenAI's shape."""
    response = live_client.post("/v1/completions", json=completion(prompt))
    assert response.status_code == status
    error = response.get_json()["error"]
    assert set(error) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------- streaming


def test_stream_completion_chunks_usage_and_done(live_client, worker) -> None:
    response = live_client.post(
        "/v1/completions",
        json=completion(stream=True, stream_options={"include_usage": True}),
    )
    assert response.status_code == 200
    assert response.mimetype == "text/event-stream"
    assert response.headers["Cache-Control"] == "no-cache"
    assert response.headers["X-Accel-Buffering"] == "no"
    messages = parse_text(response.get_data(as_text=True))
    assert messages[-1].data == "[DONE]"
    chunks = [m.json() for m in messages[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == "t0 t1 t2 "
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stream_chat_role_then_content(live_client, worker) -> None:
    response = live_client.post("/v1/chat/completions", json={**CHAT, "stream": True, "n": 2})
    messages = parse_text(response.get_data(as_text=True))
    assert messages[-1].data == "[DONE]"
    chunks = [m.json() for m in messages[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == "t0 t1 t2 "
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["delta"] == {}
        assert all(c["finish_reason"] is None for c in mine[:-1])


def test_stream_echo_sends_the_prompt_first(live_client, worker) -> None:
    response = live_client.post("/v1/completions", json=completion("say", stream=True, echo=True))
    chunks = [m.json() for m in parse_text(response.get_data(as_text=True))[:-1]]
    assert chunks[0]["choices"][0]["text"] == "say"


def test_stream_logprobs(live_client, worker) -> None:
    chat = live_client.post(
        "/v1/chat/completions", json={**CHAT, "stream": True, "logprobs": True, "top_logprobs": 1}
    )
    chunks = [m.json() for m in parse_text(chat.get_data(as_text=True))[:-1]]
    content = [c["choices"][0]["logprobs"]["content"][0] for c in chunks[1:-1]]
    assert [e["token"] for e in content] == ["t0 ", "t1 ", "t2 "]
    assert content[0]["top_logprobs"][0]["token"] == "x"
    text = live_client.post("/v1/completions", json=completion(stream=True, logprobs=1))
    chunks = [m.json() for m in parse_text(text.get_data(as_text=True))[:-1]]
    columns = [c["choices"][0]["logprobs"] for c in chunks[:-1]]
    assert [c["tokens"] for c in columns] == [["t0 "], ["t1 "], ["t2 "]]
    assert [c["text_offset"] for c in columns] == [[0], [3], [6]]
    assert columns[0]["top_logprobs"] == [{"x": -1.5}]


def test_stream_error_in_band(live_client, worker) -> None:
    response = live_client.post("/v1/completions", json=completion("toolong", stream=True))
    messages = parse_text(response.get_data(as_text=True))
    assert messages[-1].data == "[DONE]"
    assert "maximum context length" in messages[-2].json()["error"]["message"]


# ---------------------------------------------------------------- async jobs and events


def test_async_job_then_poll(live_client, worker) -> None:
    response = live_client.post("/v1/chat/completions", json=CHAT, headers=ASYNC)
    assert response.status_code == 202
    job_id = response.get_json()["id"]

    def finished():
        view = live_client.get(response.headers["Location"]).get_json()
        return view if view["status"] == "finished" else None

    view = wait_for(finished)
    assert view["result"]["choices"][0]["message"]["content"] == "t0 t1 t2 "
    assert view["result"]["id"] == f"chatcmpl-{job_id}"
    assert view["progress"]["completion_tokens"] == 3
    assert view["created_at"] <= view["started_at"] <= view["finished_at"]


def test_post_jobs_then_events(live_client, worker) -> None:
    response = live_client.post(
        "/v1/jobs", json={"endpoint": "/v1/completions", "body": completion(max_tokens=4)}
    )
    assert response.status_code == 202
    events = live_client.get(f"/v1/jobs/{response.get_json()['id']}/events")
    messages = parse_text(events.get_data(as_text=True))
    assert messages[0].retry == 2000
    tokens = [m for m in messages if m.event == "token"]
    assert [m.json()["index"] for m in tokens] == [0, 1, 2, 3]
    assert set(tokens[0].json()) == {"index", "text", "choice", "token_id"}
    assert messages[-1].event == "done"
    assert messages[-1].json()["choices"][0]["text"] == "t0 t1 t2 t3 "
    assert all(m.id for m in messages[1:])


def test_late_listener_gets_the_whole_stream(live_client, worker, real_redis) -> None:
    job_id = live_client.post(
        "/v1/completions", json=completion(max_tokens=5), headers=ASYNC
    ).get_json()["id"]
    wait_for(lambda: status_of(real_redis, job_id) == "finished")
    messages = parse_text(live_client.get(f"/v1/jobs/{job_id}/events").get_data(as_text=True))
    assert [m.json()["index"] for m in messages if m.event == "token"] == [0, 1, 2, 3, 4]
    assert messages[-1].event == "done"


def test_events_resume_without_gap_or_repeat(server, worker) -> None:
    job = httpx.post(
        f"{server}/v1/completions", headers=ASYNC, json=completion("slow", max_tokens=12)
    )
    url = f"{server}/v1/jobs/{job.json()['id']}/events"
    first: list = []
    with httpx.stream("GET", url, timeout=10) as response:
        for message in parse(response.iter_lines()):
            if message.event == "token":
                first.append(message)
                if len(first) == 3:
                    break
    rest = []
    with httpx.stream("GET", url, headers={"Last-Event-ID": first[-1].id}, timeout=10) as r:
        rest = list(parse(r.iter_lines()))
    indices = [m.json()["index"] for m in first + rest if m.event == "token"]
    assert indices == list(range(12))
    assert rest[-1].event == "done"
    # ?after= resumes the same way, from any id in the stream
    after = httpx.get(url, params={"after": first[0].id}, timeout=10).text
    assert [m.json()["index"] for m in parse_text(after) if m.event == "token"] == list(
        range(1, 12)
    )


def test_events_ping_while_idle(live_client, worker, real_redis) -> None:
    worker.paused.set()
    job_id = live_client.post("/v1/completions", json=completion(), headers=ASYNC).get_json()["id"]
    response = live_client.get(f"/v1/jobs/{job_id}/events")
    stream = response.response  # the generator: read the first messages, then resume worker
    head = (next(stream) + next(stream)).decode()
    assert head.startswith("retry: 2000") and ": ping" in head
    worker.paused.clear()
    rest = b"".join(stream).decode()
    response.close()
    assert "event: done" in rest


# ---------------------------------------------------------------- cancellation


def test_cancel_a_running_job(live_client, worker, real_redis) -> None:
    job_id = live_client.post(
        "/v1/completions", json=completion("slow", max_tokens=200), headers=ASYNC
    ).get_json()["id"]
    wait_for(lambda: real_redis.xlen(keys.job_events(job_id)) >= 2)
    response = live_client.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status_code == 202
    wait_for(lambda: status_of(real_redis, job_id) == "cancelled")
    assert real_redis.xlen(keys.job_events(job_id)) < 50
    assert live_client.post(f"/v1/jobs/{job_id}/cancel").status_code == 409
    assert live_client.post("/v1/jobs/nosuchjob/cancel").status_code == 404
    view = live_client.get(f"/v1/jobs/{job_id}").get_json()
    assert view["status"] == "cancelled" and view["error"]["code"] == "cancelled"


def test_cancel_a_finished_job_is_409(live_client, worker, real_redis) -> None:
    job_id = live_client.post("/v1/completions", json=completion(), headers=ASYNC).get_json()["id"]
    wait_for(lambda: status_of(real_redis, job_id) == "finished")
    response = live_client.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status_code == 409
    assert response.get_json()["error"]["code"] == "job_finished"


def test_stream_disconnect_cancels_the_job(server, worker, real_redis) -> None:
    """F4: a streaming client that goes away stops its generation."""
    body = {
        **CHAT,
        "messages": [{"role": "user", "content": "slow"}],
        "max_tokens": 400,
        "stream": True,
    }
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=10) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 4:
                break
    job_id = worker.processed[-1]
    wait_for(lambda: real_redis.exists(keys.job_cancel(job_id)))
    wait_for(lambda: status_of(real_redis, job_id) == "cancelled")
    assert real_redis.xlen(keys.job_events(job_id)) < 100


def _raw_post(server: str, path: str, body: dict) -> socket.socket:
    url = urlparse(server)
    sock = socket.create_connection((url.hostname, url.port))
    payload = json.dumps(body).encode()
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def test_sync_disconnect_cancels_the_job(server, worker, real_redis) -> None:
    """A synchronous client that hangs up is noticed by peeking at its socket."""
    sock = _raw_post(server, "/v1/completions", completion("slow", max_tokens=400))
    wait_for(lambda: worker.processed)
    job_id = worker.processed[-1]
    wait_for(lambda: real_redis.xlen(keys.job_events(job_id)) >= 2)
    sock.close()
    wait_for(lambda: status_of(real_redis, job_id) == "cancelled")


def test_disconnect_while_queued_never_runs(server, worker, real_redis) -> None:
    """F5: the job is taken off the queue and cancelled; the worker never sees it."""
    worker.paused.set()
    sock = _raw_post(server, "/v1/completions", completion(stream=True))
    queue_key = f"rq:queue:{keys.queue_name('tiny')}"
    job_id = wait_for(lambda: real_redis.lrange(queue_key, 0, -1))[0].decode()
    sock.close()
    wait_for(lambda: status_of(real_redis, job_id) == "cancelled")
    assert real_redis.llen(queue_key) == 0
    worker.paused.clear()
    time.sleep(0.2)
    assert job_id not in worker.processed


# ---------------------------------------------------------------- admission


def test_unknown_model_404_and_no_worker_503(live_client, worker, real_redis) -> None:
    assert live_client.post("/v1/completions", json=completion(model="nope")).status_code == 404
    worker.stop()
    real_redis.delete(keys.worker(worker.info.name))
    # the API's snapshot of served models may be this old (api/directory.py)
    time.sleep(live_client.application.extensions["directory"].max_age)
    response = live_client.post("/v1/completions", json=completion())
    assert response.status_code == 503 and response.headers["Retry-After"]
    assert live_client.get("/ready").status_code == 503


def test_concurrent_submits_never_overfill_the_queue(redis_url, real_redis, worker) -> None:
    """F10 in small: 40 concurrent submits, limit 10 -> exactly 10 accepted."""
    worker.paused.set()
    app = create_app({"TESTING": True, "REDIS_URL": redis_url, "MAX_QUEUE": 10})

    def submit(_):
        return app.test_client().post("/v1/completions", json=completion(), headers=ASYNC)

    with ThreadPoolExecutor(max_workers=20) as pool:
        responses = list(pool.map(submit, range(40)))
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [202] * 10 + [429] * 30
    assert all(r.headers.get("Retry-After") for r in responses if r.status_code == 429)
    assert real_redis.llen(f"rq:queue:{keys.queue_name('tiny')}") == 10
    assert len(job_records(real_redis)) == 10
    app.extensions["redis"].close()


def test_concurrent_idempotent_submits_make_one_job(live_app, worker, real_redis) -> None:
    """F11: the same Idempotency-Key five times at once -> one job, one id."""
    headers = {**ASYNC, "Idempotency-Key": "same-key"}

    def submit(_):
        return live_app.test_client().post("/v1/completions", json=completion(), headers=headers)

    with ThreadPoolExecutor(max_workers=5) as pool:
        responses = list(pool.map(submit, range(5)))
    assert {r.status_code for r in responses} == {202}
    assert len({r.get_json()["id"] for r in responses}) == 1
    assert len(job_records(real_redis)) == 1


def test_sync_idempotent_repeat_replays_the_result(live_client, worker) -> None:
    headers = {"Idempotency-Key": "replay-me"}
    first = live_client.post("/v1/completions", json=completion(), headers=headers).get_json()
    second = live_client.post("/v1/completions", json=completion(), headers=headers).get_json()
    assert first == second
    assert len(worker.processed) == 1


def test_chunked_body_over_the_limit_is_413(server, worker) -> None:
    """Row 22 without Content-Length: the stream is cut at 1 MiB."""

    def body():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(300):
            yield b"x" * 8192
        yield b'"}'

    response = httpx.post(
        f"{server}/v1/completions",
        content=body(),
        headers={"Content-Type": "application/json"},
        timeout=10,
    )
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{server}/health").status_code == 200


def test_many_streams_at_once(server, worker) -> None:
    def one(i):
        with httpx.stream(
            "POST",
            f"{server}/v1/completions",
            timeout=10,
            json=completion(f"p{i}", max_tokens=5, stream=True),
        ) as r:
            return [line for line in r.iter_lines() if line.startswith("data: ")][-1]

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(one, range(16))) == ["data: [DONE]"] * 16


def test_metrics_count_jobs(live_client, worker) -> None:
    live_client.post("/v1/completions", json=completion())
    text = live_client.get("/metrics").get_data(as_text=True)
    assert 'llmq_jobs_total{state="queued"} 1.0' in text
    assert 'llmq_jobs_total{state="finished"} 1.0' in text
    assert threading.active_count() < 100
