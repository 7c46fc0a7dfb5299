"""What a submission costs in the API: async completions (`Prefer: respond-async`, the
path that answers 202 once the job is queued) sent one after another through the Flask
app to a real Redis, plain, with both rate limits on (`api/rate_limits.py`: one more
script per request) and with a priority other than 0 (a level queue of its own,
`workers/keys.py` `level_queue_name`); then an async chat job (`POST /v1/jobs`) beside a
background Responses request (`POST /v1/responses`, `background: true`), which runs as the
same chat job with its Responses request kept on the record (`api/responses/routes.py`).

The load test (`make test-load`, tests/README.md "Load") measures the same path under 200
clients, where the access log's whole milliseconds and the run-to-run noise are larger
than what is measured here; this takes the API alone, sequentially, so the difference
between the rows is the cost of each feature. Rounds of each variant alternate so that a
change in the machine's load falls on all of them alike.

    .venv/bin/python bench/submission.py [--redis redis://127.0.0.1:6379/14] [--n 1500]

The Redis db is flushed before and after: give it one that holds nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import redis

from api.app import create_app
from workers import keys
from workers.wire.broker import redact
from workers.wire.worker_info import READY, WorkerInfo

MODEL = "bench-model"
ASYNC = {"Prefer": "respond-async"}


def _completion(i: int, priority: int = 0) -> tuple[str, dict, dict, int]:
    body = {"model": MODEL, "prompt": f"p {i}", "max_tokens": 8}
    if priority:
        body["priority"] = priority
    return "/v1/completions", body, ASYNC, 202


def _chat_job(i: int) -> tuple[str, dict, dict, int]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": f"p {i}"}], "max_tokens": 8}
    return "/v1/jobs", {"endpoint": "/v1/chat/completions", "body": chat}, {}, 202


def _background_response(i: int) -> tuple[str, dict, dict, int]:
    body = {"model": MODEL, "input": f"p {i}", "max_output_tokens": 8, "background": True}
    return "/v1/responses", body, {}, 200


# name -> (app settings, the i-th request: path, body, headers, the status it answers)
VARIANTS = {
    "plain": ({}, _completion),
    "rate limits on": ({"RATE_LIMIT_RPM": 10**9, "RATE_LIMIT_TPM": 10**12}, _completion),
    "priority -5": ({}, lambda i: _completion(i, priority=-5)),
    "/v1/jobs chat": ({}, _chat_job),
    "bg response": ({}, _background_response),
}


def _register(conn: redis.Redis) -> None:
    """A worker that serves MODEL, as the API's directory reads it; it never claims, so
    each round's queues are emptied by `_drain`."""
    conn.hset(keys.MODELS, MODEL, json.dumps({"context_length": 2048}))
    pool = {MODEL: {"state": READY, "memory_mb": 1.0, "in_flight": 0}}
    info = WorkerInfo(name="bench-1", pid=os.getpid(), host="bench", models=[MODEL], pool=pool)
    info.heartbeat = time.time() + 3600
    conn.sadd(keys.WORKERS, info.name)
    conn.hset(keys.worker(info.name), mapping=info.to_hash())


def _drain(conn: redis.Redis) -> None:
    for key in conn.scan_iter("rq:queue:*"):
        conn.delete(key)
    for key in conn.scan_iter(keys.queue_levels("*")):
        conn.delete(key)


def _round(client, request, n: int, offset: int) -> list[float]:
    times = []
    for i in range(n):
        path, body, headers, expected = request(offset + i)
        start = time.perf_counter()
        answer = client.post(path, json=body, headers=headers)
        times.append(time.perf_counter() - start)
        if answer.status_code != expected:
            raise SystemExit(f"{answer.status_code}: {answer.get_data(as_text=True)[:300]}")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--n", type=int, default=1500, help="submissions per variant")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    conn = redis.Redis.from_url(args.redis)
    conn.flushdb()
    _register(conn)
    clients = {}
    for name, (config, _) in VARIANTS.items():
        app = create_app({"REDIS_URL": args.redis, "MAX_QUEUE": 10**6} | config)
        clients[name] = app.test_client()
    per_round = max(1, args.n // args.rounds)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    try:
        for name, client in clients.items():  # warm each app (imports, scripts loaded)
            _round(client, VARIANTS[name][1], 20, 10**6)
        limited = clients["rate limits on"].post("/v1/completions", json={"model": MODEL})
        assert "x-ratelimit-limit-tokens" in limited.headers, "the rate limits are not on"
        assert conn.zcard(keys.queue_levels(keys.queue_name(MODEL, "interactive"))) > 0
        _drain(conn)
        for r in range(args.rounds):
            for name, client in clients.items():
                times[name] += _round(client, VARIANTS[name][1], per_round, r * per_round)
                _drain(conn)
    finally:
        conn.flushdb()
    version = conn.info("server")["redis_version"]
    print(
        f"# {platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; "
        f"broker: Redis {version} at {redact(args.redis)} (--redis)"
    )
    print(f"{'variant':<16} {'n':>6} {'p50 ms':>8} {'p99 ms':>8} {'p50 vs plain':>13}")
    base = statistics.median(times["plain"])
    for name, values in times.items():
        values.sort()
        p50, p99 = statistics.median(values), values[int(len(values) * 0.99)]
        delta = (p50 - base) * 1000
        print(f"{name:<16} {len(values):>6} {p50 * 1000:>8.2f} {p99 * 1000:>8.2f} {delta:>+12.2f}")
    ratio = statistics.median(times["bg response"]) / statistics.median(times["/v1/jobs chat"])
    print(f"a background response's submission / a /v1/jobs chat submission, p50: {ratio:.2f}x")


if __name__ == "__main__":
    main()
