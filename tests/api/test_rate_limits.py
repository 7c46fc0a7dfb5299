"""Per-caller rate limits through real HTTP (`api.rate_limits`): two API processes sharing
one Redis, OpenAI's headers and 429s, what counts and what does not, and the correction of
a request's reserved tokens to its real usage by the write that ends its job (the scripted
worker of tests/api/fake_worker.py, and a real worker on a tiny model)."""

from __future__ import annotations

import io
import json
import math
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from api.app import create_app
from api.rate_limits import go_duration
from api.token_budget import CHARS_PER_TOKEN
from tests.api.conftest import _gunicorn, serving, worker_thread
from tests.api.sse import parse
from workers import keys

pytestmark = pytest.mark.integration

ASYNC = {"Prefer": "respond-async"}
HEADER_NAMES = [
    f"x-ratelimit-{what}-{bucket}"
    for bucket in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
]
GO_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(\d+(?:\.\d{1,3})?)s$|^(\d+)ms$")


def seconds(duration: str) -> float:
    """A reset header (Go's duration format) in seconds; fails on any other format."""
    match = GO_DURATION.match(duration)
    assert match, f"not a Go duration: {duration!r}"
    hours, minutes, secs, ms = match.groups()
    if ms is not None:
        return int(ms) / 1000
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(secs)


def limits_of(response: httpx.Response) -> dict[str, str]:
    return {name: response.headers[name] for name in HEADER_NAMES if name in response.headers}


def remaining(response: httpx.Response, bucket: str) -> int:
    return int(response.headers[f"x-ratelimit-remaining-{bucket}"])


def completion(prompt: str = "hello", max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, **extra}


def reserved(prompt: str, max_tokens: int) -> int:
    """What the API reserves for a completion of a model it cannot tokenize (`tiny`):
    the prompt at CHARS_PER_TOKEN characters a token, plus max_tokens."""
    return math.ceil(len(prompt) / CHARS_PER_TOKEN) + max_tokens


@contextmanager
def limited(redis_url: str, rpm: int = 0, tpm: int = 0, **config: Any) -> Iterator[str]:
    """The app with these limits on a real HTTP server (its callers: client addresses)."""
    app = create_app(
        {"TESTING": True, "REDIS_URL": redis_url, "RATE_LIMIT_RPM": rpm, "RATE_LIMIT_TPM": tpm}
        | config
    )
    try:
        with serving(app) as url:
            yield url
    finally:
        app.extensions["redis"].close()


def settled_range(
    limit: int, used: int, submitted: tuple[float, float], looked: tuple[float, float]
) -> tuple[int, int]:
    """The tokens remaining at a look, if the bucket (full before the submission) was
    charged exactly `used`: it refills limit/60 a second between the submission and the
    look (each timed by the monotonic clock before and after its request)."""
    per_second = limit / 60
    low = limit - used + per_second * (looked[0] - submitted[1])
    high = limit - used + per_second * (looked[1] - submitted[0])
    return math.floor(low) - 1, min(limit, math.floor(high) + 1)


def timed(send) -> tuple[httpx.Response, tuple[float, float]]:
    start = time.monotonic()
    response = send()
    return response, (start, time.monotonic())


# ---------------------------------------------------------------- format


@pytest.mark.parametrize(
    ("ms", "text"),
    [(0, "0s"), (7, "7ms"), (120, "120ms"), (1000, "1s"), (8640, "8.64s"), (59_999, "59.999s")]
    + [(60_000, "1m0s"), (90_500, "1m30.5s"), (360_000, "6m0s"), (3_600_000, "1h0m0s")],
)
def test_resets_are_written_as_openai_writes_them(ms: int, text: str) -> None:
    assert go_duration(ms) == text


def test_every_reset_reads_back_as_its_duration() -> None:
    for ms in [*range(0, 2100, 7), *range(59_000, 61_500, 13), 3_599_999, 3_600_001, 7_384_250]:
        assert math.isclose(seconds(go_duration(ms)), ms / 1000), ms


# ---------------------------------------------------------------- two processes, two keys


def test_two_keys_across_two_api_processes(redis_url, real_redis, worker) -> None:
    keyset = {"LLMQ_API_KEYS": "sk-a,sk-b", "LLMQ_RATE_LIMIT_RPM": "4"}
    with (
        _gunicorn(redis_url, **keyset, LLMQ_RATE_LIMIT_TPM="600") as one,
        _gunicorn(redis_url, **keyset, LLMQ_RATE_LIMIT_TPM="600") as two,
        httpx.Client(headers={"Authorization": "Bearer sk-a"}, timeout=20) as a,
        httpx.Client(headers={"Authorization": "Bearer sk-b"}, timeout=20) as b,
    ):
        body = completion()
        answers = [
            a.post(f"{one}/v1/completions", json=body),
            a.post(f"{two}/v1/completions", json=body | {"stream": True}),
            a.post(f"{one}/v1/completions", json=body, headers=ASYNC),
            a.post(f"{two}/v1/jobs", json={"endpoint": "/v1/completions", "body": body}),
        ]
        assert [r.status_code for r in answers] == [200, 200, 202, 202]
        assert "data: [DONE]" in answers[1].text
        # each process sees what the other took: one bucket per key, in Redis
        assert [remaining(r, "requests") for r in answers] == [3, 2, 1, 0]
        assert remaining(answers[0], "tokens") == 600 - reserved("hello", 8)
        for r in answers:
            assert r.headers["x-ratelimit-limit-requests"] == "4"
            assert r.headers["x-ratelimit-limit-tokens"] == "600"
            assert remaining(r, "tokens") < 600
            assert 0 < seconds(r.headers["x-ratelimit-reset-requests"]) <= 60

        refused = a.post(f"{one}/v1/completions", json=body)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["type"] == "requests" and error["code"] == "rate_limit_exceeded"
        assert error["param"] is None and "Limit 4" in error["message"]
        retry_after = int(refused.headers["Retry-After"])
        assert 1 <= retry_after <= 15  # one of 4 requests a minute comes back every 15 s
        assert remaining(refused, "requests") == 0
        assert (
            a.post(f"{two}/v1/embeddings", json={"model": "tiny", "input": "x"}).status_code == 429
        )

        # the other key is untouched, on either process
        other = b.post(f"{two}/v1/completions", json=body)
        assert other.status_code == 200 and remaining(other, "requests") == 3
        assert remaining(other, "tokens") == 600 - reserved("hello", 8)
        # read now: b's one request is given back within 15 s (4 a minute), and a bucket
        # that is full again is not stored (workers/wire/rate_limit.py)
        stored = {k.decode() for k in real_redis.scan_iter(f"{keys.RATE_LIMIT_PREFIX}*")}
        assert len(stored) == 2 and not any("sk-" in k for k in stored)  # digests, never keys
        assert remaining(b.get(f"{one}/v1/models"), "requests") == 3

        # reading counts nothing and still carries the figures, even past the limit
        job_id = answers[2].json()["id"]
        polls = [a.get(f"{(one, two)[i % 2]}/v1/jobs/{job_id}") for i in range(6)]
        assert {p.status_code for p in polls} == {200}
        assert {remaining(p, "requests") for p in polls} == {0}
        assert remaining(b.get(f"{one}/v1/models"), "requests") == 3

        # admin and operations are never limited and carry no figures
        for path in ("/admin/queues", "/admin/workers", "/health", "/ready", "/metrics"):
            for _ in range(6):
                answer = httpx.get(f"{one}{path}", timeout=10)
                assert answer.status_code == 200, path
                assert not limits_of(answer), path
        assert not limits_of(httpx.get(f"{two}/openapi.json", timeout=10))
        # a caller without a valid key has no bucket: 401 without figures
        wrong = httpx.get(f"{one}/v1/models", headers={"Authorization": "Bearer sk-x"})
        assert wrong.status_code == 401 and not limits_of(wrong)


# ---------------------------------------------------------------- one process


def test_the_figures_on_every_kind_of_v1_answer(redis_url, real_redis, worker) -> None:
    with limited(redis_url, rpm=6, tpm=600) as url, httpx.Client(base_url=url, timeout=20) as c:
        fresh = c.get("/v1/models")
        assert limits_of(fresh) == {
            "x-ratelimit-limit-requests": "6",
            "x-ratelimit-remaining-requests": "6",
            "x-ratelimit-reset-requests": "0s",
            "x-ratelimit-limit-tokens": "600",
            "x-ratelimit-remaining-tokens": "600",
            "x-ratelimit-reset-tokens": "0s",
        }
        sync = c.post("/v1/completions", json=completion("hello", 8))
        assert sync.status_code == 200
        assert remaining(sync, "requests") == 5
        assert remaining(sync, "tokens") == 600 - reserved("hello", 8)
        # full again after the request's 10 s and the tokens' 100 ms each
        assert 9.9 < seconds(sync.headers["x-ratelimit-reset-requests"]) <= 10
        reset_tokens = seconds(sync.headers["x-ratelimit-reset-tokens"])
        assert reserved("hello", 8) * 0.1 - 0.1 < reset_tokens <= reserved("hello", 8) * 0.1

        # refused before the charge: figures on the error, nothing taken
        before = remaining(c.get("/v1/models"), "requests")
        bad = c.post("/v1/completions", json=completion(max_tokens=-1))
        unknown = c.post("/v1/completions", json=completion() | {"model": "nope"})
        assert (bad.status_code, unknown.status_code) == (400, 404)
        assert remaining(bad, "requests") == remaining(unknown, "requests") == before

        streamed = c.post("/v1/chat/completions", json=_chat(stream=True, max_tokens=8))
        assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
        assert remaining(streamed, "requests") == before - 1
        accepted = c.post("/v1/completions", json=completion(), headers=ASYNC)
        assert accepted.status_code == 202 and remaining(accepted, "requests") == before - 2
        for answer in (fresh, sync, bad, unknown, streamed, accepted):
            for bucket in ("requests", "tokens"):
                seconds(answer.headers[f"x-ratelimit-reset-{bucket}"])  # the format holds


def _chat(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


def test_past_the_limit_a_429_with_retry_after_that_takes_nothing(
    redis_url, real_redis, worker
) -> None:
    with limited(redis_url, rpm=2, tpm=6000) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        for _ in range(2):
            client.completions.create(model="tiny", prompt="hello", max_tokens=4)
        looked = httpx.get(f"{url}/v1/models")
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="tiny", prompt="hello", max_tokens=4)
        client.close()
        response = refused.value.response
        assert refused.value.code == "rate_limit_exceeded"
        assert refused.value.body["type"] == "requests"
        assert 1 <= int(response.headers["Retry-After"]) <= 30
        assert math.ceil(seconds(response.headers["x-ratelimit-reset-requests"])) <= 60
        after = httpx.get(f"{url}/v1/models")
        # the refusal took neither a request (the bucket is no later) nor tokens
        reset_after = seconds(after.headers["x-ratelimit-reset-requests"])
        assert reset_after <= seconds(looked.headers["x-ratelimit-reset-requests"])
        assert remaining(after, "tokens") >= remaining(looked, "tokens")


def test_tokens_past_the_limit_are_a_429_of_type_tokens(redis_url, real_redis, worker) -> None:
    worker.paused.set()  # queued jobs keep their whole reservation
    with limited(redis_url, rpm=2, tpm=120) as url:  # a request given back in 30 s
        first = httpx.post(f"{url}/v1/completions", json=completion("x", 60), headers=ASYNC)
        answered = time.monotonic()
        left = 120 - reserved("x", 60)
        assert first.status_code == 202 and remaining(first, "tokens") == left
        # 44 tokens short, given back at 0.5 s each: 22 s, far longer than the two requests
        # take on a busy machine (the bucket refills while they run)
        refused = httpx.post(f"{url}/v1/completions", json=completion("x", 100), headers=ASYNC)
        between = time.monotonic() - answered  # at least the server's time between them
        assert refused.status_code == 429
        assert refused.json()["error"]["type"] == "tokens"
        short_s = (reserved("x", 100) - left) * 0.5
        retry_after = int(refused.headers["Retry-After"])
        assert math.ceil(short_s - between) <= retry_after <= math.ceil(short_s)
        assert remaining(refused, "requests") == 1  # the refusal took no request


def test_a_request_larger_than_the_tokens_limit_is_refused_at_once(
    redis_url, real_redis, worker
) -> None:
    with limited(redis_url, tpm=100) as url:
        refused = httpx.post(f"{url}/v1/completions", json=completion("hello", 200))
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "request_too_large" and error["param"] == "max_tokens"
        assert f"Requested {reserved('hello', 200)}" in error["message"]
        assert "Retry-After" not in refused.headers
        assert remaining(refused, "tokens") == 100
        assert "x-ratelimit-limit-requests" not in refused.headers  # RPM is off
        fits = httpx.post(f"{url}/v1/completions", json=completion("hello", 90), timeout=20)
        assert fits.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_sync_and_streamed_requests_are_charged_their_real_usage(
    redis_url, real_redis, worker, stream: bool
) -> None:
    prompt, tpm = "p" * 2000, 600  # reserves 508 tokens; the scripted worker uses 5 + 8
    body = completion(prompt, 8)
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    with limited(redis_url, tpm=tpm) as url, httpx.Client(base_url=url, timeout=20) as c:
        answer, submitted = timed(lambda: c.post("/v1/completions", json=body))
        assert answer.status_code == 200
        assert remaining(answer, "tokens") == tpm - reserved(prompt, 8)
        if stream:
            chunks = [m.json() for m in parse(answer.text.splitlines()) if m.data != "[DONE]"]
            used = chunks[-1]["usage"]["total_tokens"]
        else:
            used = answer.json()["usage"]["total_tokens"]
        assert reserved(prompt, 8) - used > 400  # so the check below tells the two apart
        look, looked = timed(lambda: c.get("/v1/models"))
        low, high = settled_range(tpm, used, submitted, looked)
        assert low <= remaining(look, "tokens") <= high


def test_a_chat_without_max_tokens_reserves_at_most_the_whole_limit(
    redis_url, real_redis, worker
) -> None:
    with limited(redis_url, tpm=600) as url:  # the scripted model's context: 2048 tokens
        answer = httpx.post(f"{url}/v1/chat/completions", json=_chat(), timeout=20)
        assert answer.status_code == 200 and remaining(answer, "tokens") == 0
        # a chat that asks for more than the limit is refused as too large
        asked = httpx.post(f"{url}/v1/chat/completions", json=_chat(max_tokens=700))
        assert asked.status_code == 400 and asked.json()["error"]["code"] == "request_too_large"


def _finished(client: httpx.Client, job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 20
    while True:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("finished", "failed", "cancelled"):
            return job
        assert time.monotonic() < deadline, f"job {job_id} did not end"
        time.sleep(0.02)


@pytest.mark.parametrize("route", ["prefer", "jobs"])
def test_async_jobs_are_charged_their_real_usage_by_the_worker(
    redis_url, real_redis, worker, route: str
) -> None:
    prompt, tpm = "q" * 2000, 600
    body = completion(prompt, 8)
    with limited(redis_url, tpm=tpm) as url, httpx.Client(base_url=url, timeout=20) as c:
        if route == "prefer":
            send = lambda: c.post("/v1/completions", json=body, headers=ASYNC)  # noqa: E731
        else:
            job = {"endpoint": "/v1/completions", "body": body}
            send = lambda: c.post("/v1/jobs", json=job)  # noqa: E731
        accepted, submitted = timed(send)
        assert accepted.status_code == 202
        assert remaining(accepted, "tokens") == tpm - reserved(prompt, 8)
        job = _finished(c, accepted.json()["id"])
        assert job["status"] == "finished"
        used = job["result"]["usage"]["total_tokens"]
        look, looked = timed(lambda: c.get("/v1/models"))
        low, high = settled_range(tpm, used, submitted, looked)
        assert low <= remaining(look, "tokens") <= high
        assert not real_redis.hexists(keys.job(job["id"]), "ratelimit_key")  # settled once


def test_a_failed_job_is_charged_only_what_it_generated(redis_url, real_redis, worker) -> None:
    with limited(redis_url, tpm=600) as url:
        failed = httpx.post(f"{url}/v1/completions", json=completion("crash " * 100, 50))
        assert failed.status_code == 500  # the scripted engine fails before any token
        assert remaining(failed, "tokens") == 600 - reserved("crash " * 100, 50)
        assert remaining(httpx.get(f"{url}/v1/models"), "tokens") == 600


def test_embeddings_reserve_their_input_tokens(redis_url, real_redis, worker) -> None:
    inputs, tpm = ["a" * 400, "b" * 800], 600  # estimated 100 + 200 tokens
    with limited(redis_url, tpm=tpm) as url, httpx.Client(base_url=url, timeout=20) as c:
        body = {"model": "tiny", "input": inputs}
        embedded, submitted = timed(lambda: c.post("/v1/embeddings", json=body))
        assert embedded.status_code == 200
        estimate = sum(math.ceil(len(text) / CHARS_PER_TOKEN) for text in inputs)
        assert remaining(embedded, "tokens") == tpm - estimate
        used = embedded.json()["usage"]["total_tokens"]
        look, looked = timed(lambda: c.get("/v1/models"))
        low, high = settled_range(tpm, used, submitted, looked)
        assert low <= remaining(look, "tokens") <= high


def test_a_job_cancelled_while_queued_gives_back_its_tokens(redis_url, real_redis, worker) -> None:
    worker.paused.set()
    with limited(redis_url, rpm=10, tpm=600) as url, httpx.Client(base_url=url, timeout=20) as c:
        accepted = c.post("/v1/completions", json=completion("r" * 800, 100), headers=ASYNC)
        assert remaining(accepted, "tokens") == 600 - reserved("r" * 800, 100)
        cancelled = c.post(f"/v1/jobs/{accepted.json()['id']}/cancel")
        assert cancelled.status_code == 202 and cancelled.json()["status"] == "cancelled"
        look = c.get("/v1/models")
        assert remaining(look, "tokens") == 600  # it used nothing
        assert remaining(look, "requests") == 9  # a request that was accepted still counts


def test_a_refusal_after_the_charge_and_an_idempotent_repeat_give_back(
    redis_url, real_redis, worker
) -> None:
    worker.paused.set()
    body = completion("s" * 400, 50)
    with (
        limited(redis_url, rpm=10, tpm=600, MAX_QUEUE=1) as url,
        httpx.Client(base_url=url, timeout=20) as c,
    ):
        repeat = ASYNC | {"Idempotency-Key": "once"}
        first, again = (c.post("/v1/completions", json=body, headers=repeat) for _ in range(2))
        assert first.json()["id"] == again.json()["id"]
        assert remaining(again, "requests") == 8  # both were requests ...
        one_job = 600 - reserved(body["prompt"], 50)
        assert one_job <= remaining(again, "tokens") < one_job + 10  # ... for one job
        full = c.post("/v1/completions", json=body, headers=ASYNC)
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        look = c.get("/v1/models")
        assert remaining(look, "requests") == 8  # the refused one was given back
        assert one_job <= remaining(look, "tokens") < one_job + 10


def test_a_batch_counts_one_request_and_its_lines_no_tokens(redis_url, real_redis, worker) -> None:
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": _chat()}
        for i in range(5)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    with limited(redis_url, rpm=3, tpm=600) as url, httpx.Client(base_url=url, timeout=20) as c:
        uploaded = c.post(
            "/v1/files",
            data={"purpose": "batch"},
            files={"file": ("in.jsonl", io.BytesIO(content))},
        )
        assert uploaded.status_code == 200 and remaining(uploaded, "requests") == 3
        body = {
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        created = c.post("/v1/batches", json=body)
        assert created.status_code == 200
        assert remaining(created, "requests") == 2 and remaining(created, "tokens") == 600
        batch = created.json()["id"]
        assert remaining(c.get(f"/v1/batches/{batch}"), "requests") == 2


def test_without_limits_there_are_no_figures_and_no_buckets(redis_url, real_redis, worker) -> None:
    with limited(redis_url) as url:
        answer = httpx.post(f"{url}/v1/completions", json=completion(), timeout=20)
        assert answer.status_code == 200 and not limits_of(answer)
        assert not limits_of(httpx.get(f"{url}/v1/models"))
    assert not list(real_redis.scan_iter(f"{keys.RATE_LIMIT_PREFIX}*"))


# ---------------------------------------------------------------- a real worker

MODEL = "tiny-llama-ratelimit"


@pytest.fixture
def real_worker(redis_url: str, real_redis, tiny_model: Path) -> Iterator[object]:
    with worker_thread(redis_url, real_redis, tiny_model, f"rl-{uuid.uuid4().hex[:6]}") as worker:
        yield worker


def test_a_real_worker_settles_an_async_chat_at_its_usage(
    redis_url, real_redis, real_worker
) -> None:
    tpm = 600
    message = "the quick brown fox jumps over the lazy dog " * 3
    body = {"model": MODEL, "messages": [{"role": "user", "content": message}], "max_tokens": 20}
    with limited(redis_url, tpm=tpm) as url, httpx.Client(base_url=url, timeout=30) as c:
        accepted, submitted = timed(
            lambda: c.post("/v1/chat/completions", json=body, headers=ASYNC)
        )
        assert accepted.status_code == 202
        reservation = tpm - remaining(accepted, "tokens")
        job = _finished(c, accepted.json()["id"])
        assert job["status"] == "finished", job
        used = job["result"]["usage"]["total_tokens"]
        # the API estimated the prompt (it has no tokenizer for this model); the real count
        # differs by far more than the few tokens that refill while the job runs
        assert abs(reservation - used) > 30, (reservation, used)
        look, looked = timed(lambda: c.get("/v1/models"))
        low, high = settled_range(tpm, used, submitted, looked)
        assert low <= remaining(look, "tokens") <= high


def test_the_document_names_the_figures_and_the_429s(client) -> None:
    document = client.get("/openapi.json").get_json()
    assert {n for n in document["components"]["headers"] if n.startswith("x-")} == set(HEADER_NAMES)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/jobs"):
        refused = document["paths"][path]["post"]["responses"]["429"]
        assert set(refused["headers"]) == {"Retry-After", *HEADER_NAMES}, path
    assert "429" in document["paths"]["/v1/batches"]["post"]["responses"]
    ok = document["paths"]["/v1/jobs/{job_id}"]["get"]["responses"]["200"]
    assert set(ok["headers"]) == set(HEADER_NAMES)
    assert "headers" not in document["paths"]["/v1/models"]["get"]["responses"]["401"]
    assert "headers" not in document["paths"]["/admin/queues"]["get"]["responses"]["200"]
