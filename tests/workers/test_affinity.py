"""Prefix-affinity routing with two real workers on real Redis (db 10): jobs that share a
prefix reach the worker whose prefix cache holds it, overflow goes to the shared queue, and
jobs routed to a worker that dies or drains are run by the other one."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest
import redis
from rq.queue import Queue
from rq.serializers import JSONSerializer

from api import store
from tests.workers.conftest import TINY, wait_done, wait_for
from workers import affinity, keys
from workers.wire.job import CHAT_COMPLETIONS, FINISHED, JOB_FUNCTION, JobRecord
from workers.wire.worker_info import WorkerInfo

pytestmark = pytest.mark.integration

# ~210 characters: just over the routing threshold, and short enough for the tiny model's
# 256-token context with a question and a few generated tokens
SYSTEM = "You answer with one word. " * 8 + "Be brief."
OTHER = "You answer in French only. " * 8 + "Be brief."
SHARED = keys.queue_name(TINY)


@pytest.fixture(scope="module")
def redis_url(redis_url: str) -> Iterator[str]:
    """These tests' own db (10) on the workers tests' Redis."""
    yield redis_url.rsplit("/", 1)[0] + "/10"


def ask(conn: redis.Redis, system: str, question: str, max_tokens: int = 2) -> tuple[str, str]:
    """Submit a chat job as the API does: (job id, the queue it went to)."""
    body = {
        "model": TINY,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    record = JobRecord(store.new_job_id(), CHAT_COMPLETIONS, TINY, body)
    return record.id, store.enqueue(conn, record, max_queue=0)


def own(worker) -> str:
    return keys.personal_queue_name(TINY, worker.name)


def info(conn: redis.Redis, name: str) -> WorkerInfo | None:
    raw = conn.hgetall(keys.worker(name))
    return WorkerInfo.from_hash(raw) if raw else None


def cached_tokens(job) -> int:
    return job.result["usage"]["prompt_tokens_details"]["cached_tokens"]


def started_on(conn: redis.Redis, worker, system: str = SYSTEM) -> None:
    """Run a first job with `system` on `worker` (so it holds the prefix)."""
    wait_for(lambda: info(conn, worker.name), what=f"worker {worker.name} to register")
    job_id, queue = ask(conn, system, "Hi?")
    assert queue == SHARED  # nobody holds the prefix yet
    assert wait_done(conn, job_id).worker == worker.name
    wait_for(lambda: info(conn, worker.name).current_jobs == [], what="it to publish it is idle")


def wait_filed_finished(conn: redis.Redis, job_id: str) -> None:
    """RQ files a job in the shared queue's finished registry after the job function
    returns, a moment after our own record says finished."""
    registry = Queue(SHARED, connection=conn).finished_job_registry
    wait_for(lambda: job_id in registry, what=f"RQ to file {job_id} as finished")


def test_jobs_sharing_a_prefix_reach_the_worker_that_holds_it(conn, start_worker):
    a = start_worker()
    started_on(conn, a)
    b = start_worker()
    wait_for(lambda: info(conn, b.name), what="worker b to register")
    for question in ("Why?", "How?", "When?"):
        job_id, queue = ask(conn, SYSTEM, question)
        assert queue == own(a)
        done = wait_done(conn, job_id)
        assert done.status == FINISHED and done.worker == a.name
        assert cached_tokens(done) > 0  # the system prompt's prefill came from a's cache
        wait_filed_finished(conn, job_id)  # RQ's view
    assert ask(conn, OTHER, "Why?")[1] == SHARED  # a prefix nobody holds: the shared queue

    # the next turn of a conversation follows it too (a recorded it when the turn finished)
    reply = done.result["choices"][0]["message"]["content"]
    history = [("system", SYSTEM), ("user", "When?"), ("assistant", reply), ("user", "Ok?")]
    body = {
        "model": TINY,
        "messages": [{"role": role, "content": text} for role, text in history],
        "max_tokens": 1,
        "temperature": 0,
    }
    turn = JobRecord(store.new_job_id(), CHAT_COMPLETIONS, TINY, body)
    assert store.enqueue(conn, turn, max_queue=0) == own(a)
    assert wait_done(conn, turn.id).worker == a.name


def test_a_busy_holder_overflows_to_the_shared_queue_where_the_other_worker_takes_it(
    conn, start_worker
):
    a = start_worker(max_sequences=1, step_delay=0.1)
    started_on(conn, a)
    b = start_worker()
    wait_for(lambda: info(conn, b.name), what="worker b to register")
    long_id, queue = ask(conn, SYSTEM, "Go?", max_tokens=12)
    assert queue == own(a)  # a has room for it
    wait_for(lambda: info(conn, a.name).current_jobs == [long_id], what="a to run it")
    extra_id, queue = ask(conn, SYSTEM, "More?")
    assert queue == SHARED  # a's batch is full: no waiting behind it while b is idle
    assert wait_done(conn, extra_id).worker == b.name
    assert wait_done(conn, long_id).worker == a.name


def test_jobs_routed_to_a_worker_that_died_are_run_by_another(conn, spawn_worker, start_worker):
    a = spawn_worker("holder-a")
    a.wait_registered(conn)
    started_on(conn, a)
    b = start_worker(reap_interval=0.2)
    wait_for(lambda: info(conn, b.name), what="worker b to register")
    a.kill_tree()  # its hash still looks alive for up to WORKER_TTL_SECONDS
    routed = [ask(conn, SYSTEM, question) for question in ("Why?", "How?")]
    assert [queue for _, queue in routed] == [own(a)] * 2
    assert conn.llen(Queue(own(a), connection=conn).key) == 2  # b leaves a live worker's queue

    conn.delete(keys.worker(a.name))  # what the hash's TTL does to a dead worker
    for job_id, _ in routed:
        done = wait_done(conn, job_id, timeout=15)
        assert done.status == FINISHED and done.worker == b.name
        # for RQ it was a job of the shared queue all along: nothing left on a's queue's
        wait_filed_finished(conn, job_id)
    assert not conn.sismember(Queue.redis_queues_keys, Queue(own(a), connection=conn).key)


def test_a_draining_worker_hands_its_own_queue_back(conn, start_worker):
    a = start_worker(max_sequences=1, step_delay=0.1)
    started_on(conn, a)
    b = start_worker(reap_interval=0.1)
    wait_for(lambda: info(conn, b.name), what="worker b to register")
    long_id, _ = ask(conn, SYSTEM, "Go?", max_tokens=12)
    wait_for(lambda: info(conn, a.name).current_jobs == [long_id], what="a to run it")
    # two jobs that reached a's own queue while it was busy (a race the room check allows)
    waiting = [_enqueue_on(conn, own(a)) for _ in range(2)]
    time.sleep(0.5)  # b's reaper looks every 0.1 s
    assert b.reaper.release_queues() == {}
    assert conn.llen(Queue(own(a), connection=conn).key) == 2  # a is alive: they stay

    a.request_stop(signal.SIGTERM, None)  # drain: a finishes its job, hands the rest back
    for job_id in waiting:
        assert wait_done(conn, job_id).worker == b.name
    assert wait_done(conn, long_id).worker == a.name
    wait_for(lambda: info(conn, a.name) is None, what="a to stop")


def _enqueue_on(conn: redis.Redis, own_queue: str) -> str:
    """A job of the shared queue waiting on a worker's own queue, as `store.enqueue` puts it."""
    job_id = store.new_job_id()
    body = {"model": TINY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    conn.hset(keys.job(job_id), mapping=JobRecord(job_id, CHAT_COMPLETIONS, TINY, body).to_hash())
    shared = Queue(SHARED, connection=conn, serializer=JSONSerializer)
    with conn.pipeline() as pipe:
        shared.enqueue_call(
            func=JOB_FUNCTION, args=[job_id], job_id=job_id, description=job_id, pipeline=pipe
        )
        pipe.lrem(shared.key, -1, job_id)
        pipe.rpush(Queue(own_queue, connection=conn).key, job_id)
        pipe.execute()
    return job_id


def test_release_moves_a_queue_in_order_to_the_front_of_the_shared_queue(conn):
    own_key = Queue(keys.personal_queue_name(TINY, "gone"), connection=conn).key
    shared_key = Queue(SHARED, connection=conn).key
    conn.rpush(own_key, "a", "b")
    conn.rpush(shared_key, "x")
    conn.sadd(Queue.redis_queues_keys, own_key, shared_key)
    assert affinity.release_orphaned(conn, "me") == {keys.personal_queue_name(TINY, "gone"): 2}
    assert conn.lrange(shared_key, 0, -1) == [b"a", b"b", b"x"]
    assert not conn.exists(own_key)
    assert conn.smembers(Queue.redis_queues_keys) == {shared_key.encode()}
