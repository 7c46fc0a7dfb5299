"""What a worker tells the rest of the system about itself, and what it is told.

The API never talks to a worker directly: it reads `keys.worker(name)` (a `WorkerInfo`
hash with a TTL, rewritten every heartbeat), `keys.WORKERS` and `keys.MODELS` for /admin,
/ready and /v1/models, and pushes admin commands onto `keys.worker_commands(name)`. Whoever
queues a job also pushes a token onto the queue's wake list (`keys.queue_wake`), which an
idle worker waits on together with its commands.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from workers import keys
from workers.wire.commands import decode_command
from workers.wire.defaults import WORKER_TTL_SECONDS
from workers.wire.members import each_member
from workers.wire.text import as_str
from workers.wire.wake import push_wake
from workers.wire.worker_info import WorkerInfo

log = logging.getLogger("llmq.presence")

MAX_COMMANDS_PER_TICK = 16


class Presence:
    def __init__(
        self,
        connection: Any,
        info: WorkerInfo,
        models: dict[str, dict[str, Any]],
        wake_keys: list[str] | None = None,
    ):
        self.connection = connection
        self.info = info
        self.models = models  # model id -> JSON-able description for keys.MODELS
        self.wake_keys = wake_keys or []  # keys.queue_wake of every queue it takes jobs from

    def publish(
        self,
        state: str,
        current_jobs: list[str],
        pool: dict[str, Any],
        loop: dict[str, float] | None = None,
    ) -> None:
        """Rewrite this worker's hash (with its TTL), its name in the set, and the models."""
        self.info.state = state
        self.info.current_jobs = current_jobs
        self.info.pool = pool
        if loop is not None:
            self.info.loop = loop
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

    def described(self, model: str) -> dict[str, Any] | None:
        """What `keys.MODELS` says of `model`, or None if this worker does not describe it."""
        return self.models.get(model)

    def learn(self, model: str, learned: dict[str, Any]) -> bool:
        """Fold facts about `model` into its description; True if any changed."""
        described = self.models.get(model)
        if described is None or all(described.get(k) == v for k, v in learned.items()):
            return False
        described.update(learned)
        return True

    def pool_changed(self, pool: dict[str, Any]) -> bool:
        """True if the pool differs from the one last published."""
        return pool != self.info.pool

    def pool_state_changed(self, pool: dict[str, Any]) -> bool:
        """True if the pool differs from the one last published in more than the figures that
        move with nearly every step (`STEP_STATS`): a load, a failure, an unload, jobs coming
        or going, which /ready and the API's routing need at once."""
        return _without_step_stats(pool) != _without_step_stats(self.info.pool)

    def withdraw(self) -> None:
        with self.connection.pipeline() as pipe:
            pipe.delete(keys.worker(self.info.name))
            pipe.srem(keys.WORKERS, self.info.name)
            pipe.execute()

    def prune(self) -> list[str]:
        """Drop names from `keys.WORKERS` whose hash expired (workers that died)."""
        hashes = each_member(self.connection, keys.WORKERS, lambda p, n: p.exists(keys.worker(n)))
        dead = [name for name, exists in hashes if not exists]
        if dead:
            self.connection.srem(keys.WORKERS, *dead)
        return dead

    def commands(self, wait: float = 0.0) -> list[tuple[str, str]]:
        """Admin commands waiting for this worker, as (op, model); with `wait`, block up to
        that long for the first one or for a wake token (a job was queued on one of its
        queues): the idle loop's sleep, cut short by either."""
        key = keys.worker_commands(self.info.name)
        raw = self._wait(key, wait) if wait > 0 else []
        raw += self.connection.lpop(key, MAX_COMMANDS_PER_TICK) or []
        out = []
        for item in raw:
            try:
                out.append(decode_command(item))
            except ValueError as exc:
                log.warning("ignoring an admin command that is not valid: %s", exc)
        return out

    def _wait(self, key: str, wait: float) -> list[bytes]:
        """One BLPOP on the command list and the wake lists (commands first, so a stream of
        jobs never starves them): a command is returned, a wake token only ends the wait.

        Wake lists are not drained: a shared queue's list belongs to every worker serving the
        queue, and each token should wake one of them; a token left over from busy times
        costs one empty claim (`wire.defaults.WAKE_MAX_TOKENS` at most per list).
        """
        popped = self.connection.blpop([key, *self.wake_keys], timeout=wait)
        if popped is None or as_str(popped[0]) != key:
            return []
        return [popped[1]]


def wake(connection: Any, queue: str) -> None:
    """Wake an idle worker serving `queue` for jobs just put (back) on it outside the API's
    enqueue (a reaper's requeue, a released own queue), so they start now, not at a poll."""
    with connection.pipeline(transaction=False) as pipe:
        push_wake(pipe, keys.queue_wake(queue))
        pipe.execute()


# A model entry's figures that change as sequences decode (KV memory in use, the prefix
# cache's counters). Publishing each change cost a 3 ms write ~6 times a second at one stream
# and every step at 32 (bench/log/2026-11-24-third-session-avx512-epyc.md); they go out at
# most every POOL_STATS_SECONDS.
STEP_STATS = ("kv_in_use_mb", "prefix_cache")
POOL_STATS_SECONDS = 1.0


def _without_step_stats(pool: dict[str, Any] | None) -> dict[str, Any]:
    return {
        model: (
            {k: v for k, v in entry.items() if k not in STEP_STATS}
            if isinstance(entry, dict)
            else entry
        )
        for model, entry in (pool or {}).items()
    }
