"""This process's answered requests, added to the shared counter (`keys.METRIC_REQUESTS`,
rendered by api/metrics.py) once a second instead of once a request.

A HINCRBY per request was a round trip and a pool checkout on every answer: ~5% of the
API's CPU for an async submission under gevent (py-spy of `llmq api`, the load test's
path). The counts now wait in memory for at most `FLUSH_SECONDS`, then go as one pipelined
HINCRBY per route and status; the process answering `/metrics` adds its own first, so a
scrape lags the other processes by at most that. A process killed inside the window loses
that window's counts, as a request whose HINCRBY met a dead Redis did before.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import Counter

import redis

from workers import keys

log = logging.getLogger(__name__)

FLUSH_SECONDS = 1.0
_SAFE_ROUTE = re.compile(r"^[A-Za-z0-9_/<>.:-]{1,100}$")


class RequestCounts:
    """Counts by "{METHOD} {route}|{status}", flushed by a timer started with the first
    count of each window (a greenlet under gunicorn's gevent worker, a thread elsewhere)."""

    def __init__(self, flush_seconds: float = FLUSH_SECONDS) -> None:
        self.flush_seconds = flush_seconds
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def add(self, conn: redis.Redis, method: str, route: str, status: int) -> None:
        if not _SAFE_ROUTE.match(route):
            route = "other"
        with self._lock:
            self._counts[f"{method} {route}|{status}"] += 1
            if self._timer is None:
                self._timer = threading.Timer(self.flush_seconds, self.flush, args=(conn,))
                self._timer.daemon = True
                self._timer.start()

    def flush(self, conn: redis.Redis) -> None:
        """Add the counts held so far to Redis; never fails a request if Redis is down."""
        with self._lock:
            counts, self._counts = self._counts, Counter()
            if self._timer is not None and self._timer is not threading.current_thread():
                self._timer.cancel()
            self._timer = None
        if not counts:
            return
        try:
            with conn.pipeline(transaction=False) as pipe:
                for field, count in counts.items():
                    pipe.hincrby(keys.METRIC_REQUESTS, field, count)
                pipe.execute()
        except redis.RedisError as exc:
            log.debug("%d request counts not recorded: %s", counts.total(), exc)
