"""The tests' real Redis: one database a test owns (reachable or the test fails: CI never
skips the real path; empty when the test starts and emptied when it ends), the redis-server
binary every test that starts its own uses, and the session's own server."""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis

from workers.redis_server import (
    RedisBinary,
    RedisServerMissing,
    RedisServerProcess,
    find_redis_server,
)
from workers.supervisor import free_port


@contextmanager
def clean_redis_db(url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.fail(f"these tests need Redis at {url}")
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


@functools.cache
def redis_binary() -> RedisBinary:
    """The redis-server (and redis-cli) the tests start: the one on PATH, else the one
    installed with llmq (workers/redis_server.py), as `llmq serve` picks it. A machine with
    no Redis service or package runs the whole suite all the same."""
    try:
        return find_redis_server()
    except RedisServerMissing as exc:
        pytest.fail(str(exc))


def redis_cli() -> str:
    cli = redis_binary().cli
    if cli is None:
        pytest.fail(f"no redis-cli beside {redis_binary().server} or on PATH")
    return str(cli)


# The databases the test packages use on the session's Redis, by the variable that names
# each (tests/api/conftest.py, tests/workers/conftest.py, tests/workers/test_webhooks.py,
# tests/api/test_batches_end_to_end.py).
SESSION_DATABASES = {
    "LLMQ_TEST_REDIS_URL": 13,
    "LLMQ_SMOLLM2_TEST_REDIS_URL": 10,
    "LLMQ_WORKERS_TEST_REDIS_URL": 14,
    "LLMQ_BATCH_TEST_REDIS_URL": 11,
    "LLMQ_WEBHOOKS_TEST_REDIS_URL": 12,
}


def start_session_redis() -> RedisServerProcess | None:
    """A redis-server of this test session's own, on a free port, with every test package's
    variable pointed at it, unless all of them are set (a CI service, a developer's own
    Redis: then that one is used, and nothing is started). Never the Redis on 6379 merely
    because it answers: the suite flushes its databases before and after each test, so two
    test sessions on one machine (parallel CI jobs, two clones) would flush each other's
    jobs mid-test, and a user's own service on 6379 would lose databases 10-14."""
    if all(os.environ.get(variable) for variable in SESSION_DATABASES):
        return None
    port = free_port()
    folder = tempfile.mkdtemp(prefix="llmq-test-redis-")  # its files, if it writes any
    server = RedisServerProcess(redis_binary(), port, extra_args=("--dir", folder))
    server.start()
    for variable, db in SESSION_DATABASES.items():
        os.environ.setdefault(variable, f"redis://127.0.0.1:{port}/{db}")
    return server
