"""A worker's idle wait (real Redis): one BLPOP on its command list and the wake lists of
its queues, so a queued job ends the wait at once and admin commands still arrive."""

from __future__ import annotations

import threading
import time

import redis

from workers import keys
from workers.presence import Presence, wake
from workers.wire.commands import encode_command
from workers.wire.defaults import WAKE_MAX_TOKENS, WAKE_TTL_SECONDS
from workers.wire.wake import push_wake
from workers.wire.worker_info import WorkerInfo

QUEUES = [keys.personal_queue_name("tiny", "w1"), keys.queue_name("tiny")]


def presence(conn: redis.Redis) -> Presence:
    wake_keys = [keys.queue_wake(q) for q in QUEUES]
    return Presence(conn, WorkerInfo(name="w1", queues=QUEUES), {}, wake_keys)


def push_later(conn: redis.Redis, key: str, value: str, delay: float) -> threading.Timer:
    timer = threading.Timer(delay, conn.lpush, (key, value))
    timer.start()
    return timer


def test_a_wake_list_keeps_a_few_tokens_and_expires(conn):
    key = keys.queue_wake(keys.queue_name("tiny"))
    for _ in range(3 * WAKE_MAX_TOKENS):
        with conn.pipeline() as pipe:
            push_wake(pipe, key)
            pipe.execute()
    assert conn.llen(key) == WAKE_MAX_TOKENS
    assert 0 < conn.ttl(key) <= WAKE_TTL_SECONDS


def test_wake_pushes_one_token_for_the_queue(conn):
    wake(conn, keys.queue_name("tiny", keys.BATCH))
    assert conn.lrange(keys.queue_wake(keys.queue_name("tiny", keys.BATCH)), 0, -1) == [b"1"]


def test_a_wake_token_ends_the_idle_wait_at_once_and_is_spent(conn):
    for queue in QUEUES:  # the worker's own queue and the shared one both wake it
        timer = push_later(conn, keys.queue_wake(queue), "1", 0.2)
        started = time.monotonic()
        assert presence(conn).commands(wait=3.0) == []
        assert time.monotonic() - started < 1.0
        timer.join()
        assert conn.llen(keys.queue_wake(queue)) == 0


def test_a_command_sent_during_the_idle_wait_arrives_at_once(conn):
    command = encode_command("load", "tiny")
    timer = push_later(conn, keys.worker_commands("w1"), command, 0.2)
    started = time.monotonic()
    assert presence(conn).commands(wait=3.0) == [("load", "tiny")]
    assert time.monotonic() - started < 1.0
    timer.join()


def test_commands_come_before_wake_tokens_and_none_is_lost(conn):
    wake(conn, keys.queue_name("tiny"))
    conn.lpush(keys.worker_commands("w1"), encode_command("unload", "tiny"))
    conn.rpush(keys.worker_commands("w1"), encode_command("load", "tiny"))
    assert presence(conn).commands(wait=1.0) == [("unload", "tiny"), ("load", "tiny")]
    assert conn.llen(keys.queue_wake(keys.queue_name("tiny"))) == 1  # still there: next wait
    assert presence(conn).commands(wait=1.0) == []
    assert conn.llen(keys.queue_wake(keys.queue_name("tiny"))) == 0


def test_with_neither_the_wait_lasts_the_poll_interval(conn):
    started = time.monotonic()
    assert presence(conn).commands(wait=0.3) == []
    assert time.monotonic() - started >= 0.25


def test_one_token_for_a_shared_queue_wakes_one_of_its_idle_workers(conn, redis_url):
    clients = [redis.Redis.from_url(redis_url) for _ in range(2)]
    woken: list[float] = []

    def idle(client: redis.Redis) -> None:
        started = time.monotonic()
        presence(client).commands(wait=1.5)
        woken.append(time.monotonic() - started)

    threads = [threading.Thread(target=idle, args=(c,)) for c in clients]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    wake(conn, keys.queue_name("tiny"))
    for thread in threads:
        thread.join(5)
    for client in clients:
        client.close()
    assert sorted(w < 1.0 for w in woken) == [False, True]  # the other slept its poll out
