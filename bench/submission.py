"""What a submission costs in the API: async completions (`Prefer: respond-async`, the
path that answers 202 once the job is queued) sent one after another through the Flask
app to a real Redis, plain, with both rate limits on (`api/rate_limits.py`: one more
script per request) and with a priority other than 0 (a level queue of its own,
`workers/keys.py` `level_queue_name`).

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
VARIANTS = {
    "plain": ({}, 0),
    "rate limits on": ({"RATE_LIMIT_RPM": 10**9, "RATE_LIMIT_TPM": 10**12}, 0),
    "priority -5": ({}, -5),
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


def _round(client, priority: int, n: int, offset: int) -> list[float]:
    times = []
    for i in range(n):
        body = {"model": MODEL, "prompt": f"p {offset + i}", "max_tokens": 8}
        if priority:
            body["priority"] = priority
        start = time.perf_counter()
        answer = client.post("/v1/completions", json=body, headers={"Prefer": "respond-async"})
        times.append(time.perf_counter() - start)
        if answer.status_code != 202:
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
            _round(client, VARIANTS[name][1], 20, 0)
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


if __name__ == "__main__":
    main()
