"""api/request_counts.py: answered requests reach the shared counter once a second, and a
scrape of `/metrics` includes what its own process answered up to then.

Another test's app may still flush its last second of counts into this Redis database after
that test ended, so these look only at routes no other test answers, or at differences."""

from __future__ import annotations

import httpx
import redis

from api.request_counts import RequestCounts
from tests.workers.conftest import wait_for
from workers import keys


def _counts(conn: redis.Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in conn.hgetall(keys.METRIC_REQUESTS).items()}


def _add_some(counts: RequestCounts, conn: redis.Redis, route: str) -> dict[str, int]:
    """Counts three answers on `route` (one label never chosen by the caller); returns the
    fields they become."""
    for _ in range(3):
        counts.add(conn, "POST", f"/counted/{route}", 202)
    counts.add(conn, "GET", f"/counted/{route}/<job_id>", 404)
    counts.add(conn, "GET", f"/counted {route}\r\n", 200)  # never a label it did not choose
    return {f"POST /counted/{route}|202": 3, f"GET /counted/{route}/<job_id>|404": 1}


def test_counts_wait_in_memory_until_their_window_ends(real_redis) -> None:
    counts = RequestCounts(flush_seconds=3600)  # a window no test outlives
    expected = _add_some(counts, real_redis, "held")
    before = _counts(real_redis)
    assert not set(before) & set(expected)  # nothing sent inside the window
    counts.flush(real_redis)  # at once, as `/metrics` does for its own process
    after = _counts(real_redis)
    assert {k: v for k, v in after.items() if k in expected} == expected
    assert after["GET other|200"] > before.get("GET other|200", 0)  # the unsafe label's
    assert not any("\r" in field or "held\n" in field for field in after)


def test_the_window_s_timer_sends_them_in_one_flush(real_redis) -> None:
    counts = RequestCounts(flush_seconds=0.3)
    expected = _add_some(counts, real_redis, "timed")

    def ours() -> dict[str, int]:
        return {k: v for k, v in _counts(real_redis).items() if k in expected}

    wait_for(lambda: ours() == expected, 30, "the window's own flush")
    counts.add(real_redis, "POST", "/counted/timed", 202)  # a new window, a new timer
    wait_for(lambda: ours()["POST /counted/timed|202"] == 4, 30, "the next window's flush")


def test_a_flush_to_a_dead_redis_drops_its_counts_and_raises_nothing(real_redis) -> None:
    dead = redis.Redis(port=1, socket_connect_timeout=0.2)
    counts = RequestCounts(flush_seconds=60)
    counts.add(dead, "POST", "/counted/dead", 503)
    counts.flush(dead)
    counts.flush(real_redis)  # nothing held any more
    assert "POST /counted/dead|503" not in _counts(real_redis)


def test_gunicorn_counts_requests_without_a_scrape_and_renders_them(gunicorn, real_redis) -> None:
    """The real path: gevent's worker runs the timer as a greenlet."""
    headers = {"Authorization": "Bearer sk-test"}
    field = "GET /v1/models|200"
    before = _counts(real_redis).get(field, 0)
    for _ in range(5):
        assert httpx.get(f"{gunicorn}/v1/models", headers=headers, timeout=10).status_code == 200
    wait_for(lambda: _counts(real_redis).get(field, 0) - before == 5, 10, "the counts in Redis")
    scrape = httpx.get(f"{gunicorn}/metrics", headers=headers, timeout=10).text
    line = 'llmq_http_requests_total{method="GET",route="/v1/models",status="200"} '
    values = [float(x[len(line) :]) for x in scrape.splitlines() if x.startswith(line)]
    assert values == [float(_counts(real_redis)[field])] and values[0] >= 5, scrape[:2000]
