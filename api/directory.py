"""The models workers publish and the ones a live worker serves, read at most once a second.

Every submission asks whether its model exists and is served (and whether `model` names a
LoRA adapter). Read from Redis each time, that is four round trips per request (the models
hash, the worker set, each worker's hash), and under load a submission spends most of its
time waiting on round trips. One API process keeps the answer for `MAX_AGE_SECONDS`: a
model that the snapshot says is missing or unserved is read again before the request is
refused, so a worker that just came up is never reported absent; a worker that died
within the last second may still be taken for live, which a submission can meet anyway
(its job waits on the queue for the next worker, as recovery expects: docs/faults.md F1).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from api import store

MAX_AGE_SECONDS = 1.0


@dataclass(frozen=True)
class Directory:
    models: dict[str, dict[str, Any]]  # published model id -> its info
    served: frozenset[str]  # models a live worker serves now
    read_at: float = field(default_factory=time.monotonic)

    @classmethod
    def read(cls, conn: redis.Redis) -> Directory:
        return cls(
            store.known_models(conn), frozenset(store.served_models(store.live_workers(conn)))
        )

    def has(self, model: str) -> bool:
        """Whether this snapshot lets a request for `model` through without a fresh look."""
        return model in self.models and model in self.served


class DirectoryCache:
    """The latest `Directory` of one API process, shared by its request threads."""

    def __init__(self, max_age: float = MAX_AGE_SECONDS) -> None:
        self.max_age = max_age
        self._lock = threading.Lock()
        self._latest: Directory | None = None

    def get(self, conn: redis.Redis, model: str | None = None) -> Directory:
        """A snapshot in which `model` (if given) is known and served, else one read after
        this call began (which then says whether it is). A snapshot older than `max_age`
        is still used while one thread reads the next: requests never queue behind that
        read, which under load takes a few round trips."""
        asked = time.monotonic()
        latest = self._latest
        if latest is not None and (model is None or latest.has(model)):
            if asked - latest.read_at < self.max_age:
                return latest
            if not self._lock.acquire(blocking=False):
                return latest  # another thread is reading the next one
            try:
                if self._latest is latest:
                    self._latest = Directory.read(conn)
                return self._latest
            finally:
                self._lock.release()
        with self._lock:  # one thread reads; the ones queued behind it reuse its read
            latest = self._latest
            if latest is None or latest.read_at < asked:
                latest = self._latest = Directory.read(conn)
            return latest
