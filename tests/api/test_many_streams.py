"""Many streams through one API process (`llmq api`'s gunicorn, one process): every stream
gets its headers while its job still waits in the queue, all finish with [DONE] once a worker
runs them, none is told `broker_down`, and a client that hangs up among hundreds still
cancels its job (docs/faults.md F4 at scale).

Before api/streams/stream_hub.py and api/gevent_worker.py, each stream held one of the process's 32
threads and a pooled Redis connection: the 33rd stream got no headers until one ended, and
under gevent alone the 101st got 503 `broker_down` (redis-py's pool cap, MaxConnectionsError).
The requests' Redis pool here is 8 connections, so streams must not hold one (the
stream readers have a pool of their own: one blocking connection per 256 streams).
Timeouts are generous: the test checks outcomes, not speed (bench/streams.py measures it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from api.streams.stream_hub import MAX_READERS
from tests.api.conftest import _gunicorn
from tests.api.fake_worker import FakeWorker
from tests.workers.conftest import wait_for
from workers import keys

pytestmark = pytest.mark.integration

STREAMS = 300
# How long the streams may take to open on a busy machine. No worker runs meanwhile and the
# API's ping is an hour away (`small_pool_api`), so a header that comes at all was sent at
# once: nothing else could carry it. The outcome is waited for, not timed.
OPEN_BOUND_S = 120.0
AUTH = {"Authorization": "Bearer sk-test"}


@pytest.fixture
def small_pool_api(redis_url: str, real_redis: redis.Redis) -> Iterator[str]:
    with _gunicorn(redis_url, LLMQ_API_REDIS_CONNECTIONS="8", LLMQ_SSE_PING_SECONDS="3600") as base:
        yield base


def _body(i: int) -> dict:
    return {"model": "tiny", "prompt": f"many {i}", "max_tokens": 4, "stream": True}


async def _stream(http: httpx.AsyncClient, base: str, i: int, headers: list, out: dict) -> None:
    """One client: its status once headers come, then every data line until [DONE]."""
    async with http.stream("POST", f"{base}/v1/completions", json=_body(i), headers=AUTH) as r:
        headers.append(r.status_code)
        lines = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                if line == "data: [DONE]":
                    break
        out[i] = lines


async def _open_all(base: str, worker: FakeWorker) -> tuple[list[int], dict, float, str]:
    limits = httpx.Limits(max_connections=STREAMS + 10, max_keepalive_connections=0)
    timeout = httpx.Timeout(120, connect=60)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        headers: list[int] = []
        out: dict[int, list[str]] = {}
        tasks = [asyncio.create_task(_stream(http, base, i, headers, out)) for i in range(STREAMS)]
        started = time.monotonic()
        while len(headers) < STREAMS and time.monotonic() - started < OPEN_BOUND_S:
            await asyncio.sleep(0.1)
            if any(t.done() and t.exception() for t in tasks):
                break
        waited = time.monotonic() - started
        before_worker = list(headers)
        metrics = (await http.get(f"{base}/metrics")).text
        worker.start()  # only now can any job run
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return before_worker, out, waited, metrics


def test_300_streams_on_8_connections_all_get_headers_at_once_and_finish(
    small_pool_api: str, real_redis: redis.Redis
) -> None:
    worker = FakeWorker(real_redis).register()  # alive and serving, running nothing yet
    try:
        before_worker, out, waited, metrics = asyncio.run(_open_all(small_pool_api, worker))
    finally:
        worker.stop()
    assert len(before_worker) == STREAMS, (
        f"{len(before_worker)} of {STREAMS} streams had headers after {waited:.1f} s "
        "while their jobs waited in the queue"
    )
    assert set(before_worker) == {200}
    assert _gauge(metrics, "llmq_api_streams_open") == STREAMS
    # 8 for requests, and the stream readers' own pool: 300 streams need 2 readers (256
    # streams each), each holding one connection while it blocks, plus a few for wakes
    assert _gauge(metrics, "llmq_api_redis_connections_max") == 8 + MAX_READERS + 4
    assert 1 <= _gauge(metrics, "llmq_api_redis_connections_open") <= 8 + 2 + 4
    assert len(out) == STREAMS
    for lines in out.values():
        assert lines[-1] == "[DONE]"
        chunks = [json.loads(x) for x in lines[:-1]]
        assert not any("error" in c for c in chunks), [c for c in chunks if "error" in c][:1]
        text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
        assert text == "t0 t1 t2 t3 ", lines


def test_a_client_that_hangs_up_among_300_open_streams_cancels_its_job(
    small_pool_api: str, real_redis: redis.Redis
) -> None:
    """No worker runs, so 300 streams wait; 30 of them hang up and exactly their 30 jobs
    are cancelled (taken off the queue) while the other 270 stay queued."""
    FakeWorker(real_redis).register()

    async def run() -> dict[str | None, int]:
        limits = httpx.Limits(max_connections=STREAMS + 10, max_keepalive_connections=0)
        timeout = httpx.Timeout(120, connect=60)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
            opened: list[int] = []
            hang_up = {i: asyncio.Event() for i in range(STREAMS)}

            async def client(i: int) -> None:
                url = f"{small_pool_api}/v1/completions"
                async with http.stream("POST", url, json=_body(i), headers=AUTH) as r:
                    opened.append(r.status_code)
                    await hang_up[i].wait()

            tasks = [asyncio.create_task(client(i)) for i in range(STREAMS)]
            started = time.monotonic()
            while len(opened) < STREAMS and time.monotonic() - started < OPEN_BOUND_S:
                await asyncio.sleep(0.1)
            assert len(opened) == STREAMS, f"{len(opened)} of {STREAMS} streams opened"
            assert _statuses(real_redis) == {"queued": STREAMS}
            for i in range(0, STREAMS, 10):
                hang_up[i].set()  # leaves the `async with`: the connection closes
            await asyncio.gather(*[tasks[i] for i in range(0, STREAMS, 10)])
            wait_for(lambda: _statuses(real_redis).get("cancelled") == STREAMS // 10, 30, "")
            time.sleep(1.0)  # room for a wrong extra cancel to show
            statuses = _statuses(real_redis)
            for i in range(STREAMS):
                hang_up[i].set()
            with contextlib.suppress(Exception):
                await asyncio.gather(*tasks)
            return statuses

    assert asyncio.run(run()) == {"cancelled": STREAMS // 10, "queued": STREAMS - STREAMS // 10}


def _statuses(conn: redis.Redis) -> dict[str | None, int]:
    """How many jobs are in each status."""
    counts: dict[str | None, int] = {}
    for key in conn.scan_iter(keys.job("*"), count=1000):
        if conn.type(key) == b"hash":
            status = _status(conn, key.decode().removeprefix(keys.job("")))
            counts[status] = counts.get(status, 0) + 1
    return counts


def _status(conn: redis.Redis, job_id: str) -> str | None:
    raw = conn.hget(keys.job(job_id), "status")
    return None if raw is None else raw.decode()


def _gauge(metrics: str, name: str) -> float:
    """The value of a one-sample gauge in Prometheus text."""
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")
