"""What a worker tells the rest of the system about itself, and what it is told.

The API never talks to a worker directly: it reads `keys.worker(name)` (a `WorkerInfo`
hash with a TTL, rewritten every heartbeat), `keys.WORKERS` and `keys.MODELS` for /admin,
/ready and /v1/models, and pushes admin commands onto `keys.worker_commands(name)`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from workers import keys
from workers.protocol import WORKER_TTL_SECONDS, WorkerInfo, decode_command

log = logging.getLogger("llmq.presence")

MAX_COMMANDS_PER_TICK = 16


class Presence:
    def __init__(self, connection: Any, info: WorkerInfo, models: dict[str, dict[str, Any]]):
        self.connection = connection
        self.info = info
        self.models = models  # model id -> JSON-able description for keys.MODELS

    def publish(self, state: str, current_jobs: list[str], pool: dict[str, Any]) -> None:
        """Rewrite this worker's hash (with its TTL), its name in the set, and the models."""
        self.info.state = state
        self.info.current_jobs = current_jobs
        self.info.pool = pool
        self.info.heartbeat = time.time()
        key = keys.worker(self.info.name)
        with self.connection.pipeline() as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=self.info.to_hash())
            pipe.expire(key, WORKER_TTL_SECONDS)
            pipe.sadd(keys.WORKERS, self.info.name)
            if self.models:
                pipe.hset(keys.MODELS, mapping={m: json.dumps(d) for m, d in self.models.items()})
            pipe.execute()

    def withdraw(self) -> None:
        with self.connection.pipeline() as pipe:
            pipe.delete(keys.worker(self.info.name))
            pipe.srem(keys.WORKERS, self.info.name)
            pipe.execute()

    def prune(self) -> list[str]:
        """Drop names from `keys.WORKERS` whose hash expired (workers that died)."""
        names = [n.decode() for n in self.connection.smembers(keys.WORKERS)]
        if not names:
            return []
        with self.connection.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.exists(keys.worker(name))
            alive = pipe.execute()
        dead = [n for n, ok in zip(names, alive, strict=True) if not ok]
        if dead:
            self.connection.srem(keys.WORKERS, *dead)
        return dead

    def commands(self, wait: float = 0.0) -> list[tuple[str, str]]:
        """Admin commands waiting for this worker, as (op, model); with `wait`, block up to
        that long for the first one (the idle loop's sleep, cut short by a command)."""
        key = keys.worker_commands(self.info.name)
        raw: list[bytes] = []
        if wait > 0:
            popped = self.connection.blpop([key], timeout=wait)
            if popped is not None:
                raw.append(popped[1])
        raw += self.connection.lpop(key, MAX_COMMANDS_PER_TICK) or []
        out = []
        for item in raw:
            try:
                out.append(decode_command(item))
            except ValueError as exc:
                log.warning("ignoring an admin command that is not valid: %s", exc)
        return out
