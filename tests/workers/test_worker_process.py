"""Real `llmq worker` processes: a worker killed with kill -9 (its whole process tree) loses
no job and no token, SIGTERM drains, and RQ's own tools see the worker (docs/faults.md L1-L3)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from api import store
from tests.redis_db import redis_binary
from tests.workers.conftest import (
    TINY,
    _pings,
    record,
    stream,
    submit,
    tokens,
    wait_done,
    wait_for,
)
from workers import keys
from workers.wire.job import COMPLETIONS, FINISHED, QUEUED, JobRecord

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GREEDY = {"model": TINY, "temperature": 0, "ignore_eos": True}


def assert_seamless(conn, job_id: str, max_tokens: int) -> list[dict]:
    """Every index once, in order, and the final body's text is the streamed text."""
    events = stream(conn, job_id)
    assert [kind for kind, _ in events] == ["token"] * max_tokens + ["done"]
    streamed = [data for _, data in events[:-1]]
    assert [t["index"] for t in streamed] == list(range(max_tokens))
    [choice] = events[-1][1]["choices"]
    assert choice["text"] == "".join(t["text"] for t in streamed)
    assert events[-1][1]["usage"]["completion_tokens"] == max_tokens
    return streamed


def test_a_killed_workers_job_resumes_on_another_worker_without_gap_or_repeat(conn, spawn_worker):
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "resume me", "max_tokens": 120})
    first = spawn_worker("victim", step_delay_ms=40)

    def victim_started() -> bool:
        first.assert_alive()
        return bool(tokens(conn, job_id))

    wait_for(victim_started, timeout=30, what="the victim to take the job")
    spawn_worker("rescuer").wait_registered(conn)  # idle, as in docs/faults.md F1
    wait_for(lambda: len(tokens(conn, job_id)) >= 20, timeout=30, what="20 tokens")
    first.kill_tree()
    killed_at = time.monotonic()
    assert len(tokens(conn, job_id)) < 120

    wait_for(lambda: any(t["attempt"] == 2 for t in tokens(conn, job_id)), timeout=25)
    assert time.monotonic() - killed_at < 20  # lease 10 s + reaper every 2 s
    done = wait_done(conn, job_id, timeout=20)

    assert done.status == FINISHED and done.attempts == 2 and done.worker == "rescuer"
    streamed = assert_seamless(conn, job_id, 120)
    attempts = [t["attempt"] for t in streamed]
    assert attempts == sorted(attempts) and attempts[0] == 1 and attempts[-1] == 2
    # RQ's bookkeeping and the running set are closed just after the record's status
    rq_job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    wait_for(lambda: rq_job.get_status() == JobStatus.FINISHED, 5, "RQ finished")
    wait_for(lambda: not conn.smembers(keys.RUNNING), 5, "the running set empty")


def test_sigterm_finishes_short_jobs_requeues_long_ones_and_exits_zero(conn, spawn_worker):
    short = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "short", "max_tokens": 10})
    long = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "long", "max_tokens": 150})
    worker = spawn_worker("drained", "--grace", "1.5", step_delay_ms=30)
    wait_for(lambda: len(tokens(conn, long)) >= 3, timeout=30, what="the long job to start")
    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(15) == 0, worker.output()

    assert record(conn, short).status == FINISHED
    requeued = record(conn, long)
    assert requeued.status == QUEUED and 0 < requeued.completion_tokens < 150
    queue_key = f"rq:queue:{keys.queue_name(TINY)}"
    assert conn.lrange(queue_key, 0, -1) == [long.encode()]
    rq_job = Job.fetch(long, connection=conn, serializer=JSONSerializer)
    assert rq_job.get_status() == JobStatus.QUEUED
    assert not conn.smembers(keys.RUNNING) and not conn.exists(keys.job_lease(long))
    assert not conn.exists(keys.worker("drained"))
    assert "drained" not in {m.decode() for m in conn.smembers(keys.WORKERS)}

    spawn_worker("successor")
    assert wait_done(conn, long, timeout=30).status == FINISHED
    assert_seamless(conn, long, 150)


def test_an_idle_worker_starts_a_job_submitted_through_the_api_at_once_not_at_its_poll(
    conn, spawn_worker
):
    worker = spawn_worker("sleeper", "--poll-interval", "4")
    worker.wait_registered(conn)
    warm = JobRecord(store.new_job_id(), COMPLETIONS, TINY, {**GREEDY, "prompt": "warm"})
    store.enqueue(conn, warm, max_queue=0)  # the API's submit: the job and its wake token
    assert wait_done(conn, warm.id, timeout=30).status == FINISHED  # the model is loaded
    time.sleep(1.0)  # the worker is in its idle wait, which by the poll lasts 3 s more
    job = JobRecord(store.new_job_id(), COMPLETIONS, TINY, {**GREEDY, "prompt": "now"})
    submitted = time.monotonic()
    assert store.enqueue(conn, job, max_queue=0) == keys.queue_name(TINY)
    wait_for(lambda: tokens(conn, job.id), timeout=10, what="the first token")
    assert time.monotonic() - submitted < 1.0, worker.output()
    assert wait_done(conn, job.id).status == FINISHED
    worker.assert_alive()


def test_rq_info_shows_the_worker_its_queues_and_its_jobs_and_logs_no_prompt(
    conn, spawn_worker, redis_url
):
    worker = spawn_worker("visible")
    worker.wait_registered(conn)
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "CANARY-7f3a", "max_tokens": 2})
    bad = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "CANARY-7f3a", "top_p": 9})
    wait_done(conn, job_id)
    wait_done(conn, bad)
    rq_info = [sys.executable, "-m", "rq.cli", "info", "--url", redis_url]
    out = subprocess.run(rq_info, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert keys.queue_name(TINY) in out.stdout and keys.queue_name(TINY, keys.BATCH) in out.stdout
    [line] = [line for line in out.stdout.splitlines() if line.startswith("visible ")]
    assert "idle" in line and "1 finished, 1 failed" in line
    assert "1 workers, 3 queues" in out.stdout  # its own queue (prefix affinity) and 2 shared
    assert job_id in worker.output() and "CANARY" not in worker.output()  # docs/faults.md F17


@pytest.fixture
def private_redis(tmp_path) -> Iterator[tuple[str, Callable[[], None]]]:
    """A redis-server of this test's own (AOF on), and a function that restarts it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"redis://127.0.0.1:{port}/0"
    argv = [str(redis_binary().server), "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    argv += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(tmp_path)]
    servers = [subprocess.Popen(argv, stdout=subprocess.DEVNULL)]
    wait_for(lambda: _pings(url), what="redis-server to start")

    def restart(down_for: float = 2.0) -> None:
        servers[-1].terminate()  # SIGTERM: redis-server writes its AOF and exits
        servers[-1].wait(10)
        time.sleep(down_for)
        servers.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL))
        wait_for(lambda: _pings(url), what="redis-server to restart")

    yield url, restart
    for server in servers:
        if server.poll() is None:
            server.terminate()
            server.wait(10)


def test_a_redis_restart_mid_job_loses_nothing_and_the_worker_carries_on(
    spawn_worker, private_redis
):
    url, restart = private_redis
    conn = redis.Redis.from_url(url)
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "outage", "max_tokens": 100})
    worker = spawn_worker("steadfast", step_delay_ms=30, redis_url=url)
    wait_for(lambda: len(tokens(conn, job_id)) >= 10, timeout=30, what="10 tokens")
    restart()
    done = wait_done(conn, job_id, timeout=30)
    assert worker.process.poll() is None, worker.output()
    assert done.status == FINISHED and done.attempts == 1
    assert_seamless(conn, job_id, 100)
    assert "Redis unavailable" in worker.output()
    conn.close()
