"""One Redis database a test owns: reachable or the test fails (CI never skips the real
path), empty when the test starts and emptied when it ends."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis


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
