"""`priority` through real HTTP, real Redis and real `llmq worker` processes serving a tiny
model: lower is taken from the queue first (`scripts.claim`), and under a tight KV pool the
highest values give up their memory first (`runtime.generator`); batch lines stay below
interactive work whatever their priority."""

from __future__ import annotations

import itertools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.tiny_models import write_tiny_llama
from tests.workers.conftest import WorkerProcess, record, serving_workers, wait_for
from workers import keys
from workers.wire.defaults import WORKER_TTL_SECONDS
from workers.wire.job import QUEUED, STARTED

pytestmark = pytest.mark.integration

TINY = "tiny-llama"


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_llama(tmp_path / f"{TINY}.gguf")


@pytest.fixture
def start_worker(
    redis_url: str, real_redis: redis.Redis, tiny: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    names = (f"prio-w{n}" for n in itertools.count())
    with serving_workers(real_redis, tiny, redis_url) as start:
        yield lambda *extra, **kw: start(next(names), *extra, **kw)


def submit(server: str, priority: int, max_tokens: int, prompt: str = "say 1") -> str:
    body: dict[str, Any] = {
        "model": TINY,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "priority": priority,
    }
    answer = httpx.post(
        f"{server}/v1/completions", json=body, headers={"Prefer": "respond-async"}, timeout=10
    )
    assert answer.status_code == 202, answer.text
    return answer.json()["id"]


def finished(server: str, job_ids: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    """Every job's final view, once all finished."""
    views: dict[str, dict[str, Any]] = {}

    def done() -> bool:
        for job_id in job_ids:
            if job_id not in views:
                view = httpx.get(f"{server}/v1/jobs/{job_id}", timeout=10).json()
                if view["status"] in ("finished", "failed", "cancelled"):
                    views[job_id] = view
        return len(views) == len(job_ids)

    wait_for(done, timeout, "every job to end")
    assert {v["status"] for v in views.values()} == {"finished"}, views
    return views


def test_urgent_jobs_submitted_after_40_queued_ones_finish_before_most_of_them(
    server: str, real_redis: redis.Redis, start_worker
) -> None:
    """Compared with the plain jobs still queued once the urgent ones are in, read from their
    records: how many the worker ran before the urgent ones arrived depends on how fast this
    machine submits, not on the priority (on two busy cores it finished 12-22 of the 40)."""
    worker = start_worker("--max-batch", "2", step_delay_ms=20)  # full at two sequences
    worker.process.send_signal(signal.SIGSTOP)  # the 40 are all queued before it takes one
    try:
        with _listed_while_stopped(real_redis, worker.name):
            plain = [submit(server, 0, 8, f"say {i}") for i in range(40)]
    finally:
        worker.process.send_signal(signal.SIGCONT)
    wait_for(lambda: STARTED in _statuses(real_redis, plain), 60, "a plain job running")
    urgent = [submit(server, -3, 8, f"now {i}") for i in range(5)]
    statuses = _statuses(real_redis, plain)
    still_queued = [j for j, status in zip(plain, statuses, strict=True) if status == QUEUED]
    assert len(still_queued) >= 10, f"the worker ran {40 - len(still_queued)} before the urgent"
    views = finished(server, plain + urgent, 180)
    assert all(views[j]["priority"] == -3 for j in urgent)
    for job_id in urgent:
        ended = views[job_id]["finished_at"]
        before = [j for j in still_queued if views[j]["finished_at"] < ended]
        # claimed after every urgent job, so at most one shares the last urgent job's batch
        assert len(before) <= 1, (len(before), len(still_queued))


@contextmanager
def _listed_while_stopped(conn: redis.Redis, name: str) -> Iterator[None]:
    """The stopped worker's own presence hash kept fresh while the test holds it stopped: a
    worker whose heartbeat is older than WORKER_TTL_SECONDS is dead to the API (503
    no_worker), and the 40 submissions over HTTP took longer than that on two busy cores. Its
    next heartbeat after SIGCONT rewrites the hash as it is (workers/presence.py)."""
    stop = threading.Event()

    def keep() -> None:
        key = keys.worker(name)
        while not stop.wait(1.0):
            if conn.exists(key):
                conn.hset(key, "heartbeat", repr(time.time()))
                conn.expire(key, WORKER_TTL_SECONDS)

    keeper = threading.Thread(target=keep, daemon=True)
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join()


def _statuses(conn: redis.Redis, job_ids: list[str]) -> list[str]:
    return [record(conn, job_id).status for job_id in job_ids]


def test_under_a_tight_kv_pool_the_highest_priority_value_is_preempted_first(
    server: str, start_worker
) -> None:
    """1 MiB of KV holds 2,048 tokens of the tiny model; twelve sequences of ~235 tokens need
    more, so the scheduler must preempt: only the priority-5 jobs, never the urgent ones."""
    start_worker("--max-batch", "16", "--kv-memory-mb", "1")
    background = [submit(server, 5, 230, f"bg {i}") for i in range(6)]
    urgent = [submit(server, -5, 230, f"fg {i}") for i in range(6)]
    views = finished(server, background + urgent, 180)
    assert [views[j]["preemptions"] for j in urgent] == [0] * len(urgent)
    assert sum(views[j]["preemptions"] for j in background) > 0
    for job_id in background + urgent:  # a preempted job still generates all it was asked
        assert views[job_id]["result"]["usage"]["completion_tokens"] == 230


def test_the_queue_gate_counts_and_lists_every_priority_level(
    server: str, real_redis: redis.Redis, start_worker
) -> None:
    """With the worker paused no job is taken: jobs wait on their levels, `/admin/queues`
    lists each level with its priority, and a cancel takes a job off its level."""
    worker = start_worker()
    worker.process.send_signal(19)  # SIGSTOP: registered and alive, takes nothing
    try:
        ids = {p: submit(server, p, 4) for p in (-2, 0, 9)}
        queues = httpx.get(f"{server}/admin/queues", timeout=10).json()["data"]
        waiting = {q["name"]: (q["priority"], q["queued"]) for q in queues}
        shared = keys.queue_name(TINY)
        assert waiting[shared] == (0, 1)
        assert waiting[keys.level_queue_name(shared, -2)] == (-2, 1)
        assert waiting[keys.level_queue_name(shared, 9)] == (9, 1)
        cancelled = httpx.post(f"{server}/v1/jobs/{ids[9]}/cancel", timeout=10)
        assert cancelled.status_code == 202, cancelled.text
        assert httpx.get(f"{server}/v1/jobs/{ids[9]}", timeout=10).json()["status"] == "cancelled"
        level_key = f"rq:queue:{keys.level_queue_name(shared, 9)}"
        assert real_redis.llen(level_key) == 0
    finally:
        worker.process.send_signal(18)  # SIGCONT
    finished(server, [ids[-2], ids[0]], 60)
