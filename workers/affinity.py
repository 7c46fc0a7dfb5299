"""Prefix-affinity routing: a job whose prompt starts like an earlier one goes to the worker
whose prefix cache holds that start, when several workers serve its model.

- A worker serves its own interactive queue of each model (`keys.personal_queue_name`)
  before the shared queues (`personal_queues`). A job on it is still, for RQ, a job of the
  shared queue (its origin, registries and results), so nothing of RQ's is left behind on
  the queue of a worker that is gone; the own queue only decides who takes the job.
- When it starts a job whose request has a `wire.prefix.prefix_digest`, it records itself under
  `keys.affinity(model, digest)`; when a chat job finishes it also records the digest the
  conversation's next turn will have (`wire.prefix.continuation_digest`). Each entry has a TTL.
- The API (`api.store.enqueue`) puts a job on the recorded worker's own queue only while
  that worker is alive, not draining, and has room for it now (its running jobs plus its
  own queue below `max_sequences`, and at most `AFFINITY_MAX_QUEUED` waiting); anything else
  goes to the shared queue that every worker serves, so no job waits on a busy worker
  while another is idle.
- Jobs left on the own queue of a worker that drains are moved back to the shared queue
  by that worker (`release`); those of a worker that died or stopped serving the queue, by
  every other worker's reaper (`release_orphaned`) once its heartbeat is stale; an idle
  worker of the shared queue is woken for them (`presence.wake`).
"""

from __future__ import annotations

import logging
from typing import Any

from rq.queue import Queue

from workers import keys, scripts
from workers.presence import wake
from workers.wire.defaults import AFFINITY_TTL_SECONDS
from workers.wire.job import CHAT_COMPLETIONS, JobRecord
from workers.wire.prefix import continuation_digest, prefix_digest
from workers.wire.worker_info import WorkerInfo

log = logging.getLogger("llmq.affinity")


def personal_queues(queue_names: list[str], worker: str) -> list[str]:
    """`queue_names` with the worker's own queue of each interactive one in front."""
    own = []
    for name in queue_names:
        model, kind = keys.parse_queue_name(name)
        if kind == keys.INTERACTIVE:
            own.append(keys.personal_queue_name(model, worker))
    return own + queue_names


def remember_start(pipe: Any, worker: str, record: JobRecord) -> None:
    """This worker is about to prefill the job's prompt: later jobs sharing its prefix should
    come here (queued on `pipe`)."""
    _remember(pipe, worker, record.model, prefix_digest(record.endpoint, record.request))


def remember_reply(pipe: Any, worker: str, record: JobRecord, result: dict[str, Any]) -> None:
    """A chat job finished here: the next turn of the conversation should come here too."""
    if record.endpoint != CHAT_COMPLETIONS:
        return
    try:
        reply = result["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return
    if isinstance(reply, str):
        _remember(
            pipe, worker, record.model, continuation_digest(record.endpoint, record.request, reply)
        )


def _remember(pipe: Any, worker: str, model: str, digest: str | None) -> None:
    if digest is not None:
        pipe.set(keys.affinity(model, digest), worker, ex=AFFINITY_TTL_SECONDS)


def release(connection: Any, name: str) -> int:
    """Move every job waiting on a worker's own queue to the front of the shared queue, in
    order, and drop the queue from RQ's queue set; how many jobs moved. (Their RQ origin is
    the shared queue already: the own queue only decides who takes them.)"""
    shared = keys.shared_queue_name(name)
    moved = scripts.release(
        connection,
        Queue(name, connection=connection).key,
        Queue(shared, connection=connection).key,
        Queue.redis_queues_keys,
    )
    if moved:
        wake(connection, shared)
    return moved


def release_orphaned(connection: Any, worker: str) -> dict[str, int]:
    """Release the own queues of other workers that will not run them (dead: stale or
    missing heartbeat; draining; or no longer serving that queue): queue name -> jobs moved."""
    names = [n for n in _personal_queue_names(connection) if keys.queue_owner(n) != worker]
    if not names:
        return {}
    with connection.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.hgetall(keys.worker(keys.queue_owner(name) or ""))
        hashes = pipe.execute()
    moved = {}
    for name, raw in zip(names, hashes, strict=True):
        if raw and _takes(raw, name):
            continue
        moved[name] = release(connection, name)
        if moved[name]:
            log.warning("moved %d job(s) from %s to the shared queue", moved[name], name)
    return moved


def _personal_queue_names(connection: Any) -> list[str]:
    prefix = Queue.redis_queue_namespace_prefix
    names = []
    for key in connection.smembers(Queue.redis_queues_keys):
        text = key.decode() if isinstance(key, bytes) else key
        if text.startswith(prefix + keys.PREFIX + "-") and _is_personal(text[len(prefix) :]):
            names.append(text[len(prefix) :])
    return names


def _is_personal(name: str) -> bool:
    try:
        keys.parse_queue_name(name)
    except ValueError:
        return False
    return keys.queue_owner(name) is not None


def _takes(raw: dict[Any, Any], name: str) -> bool:
    try:
        return WorkerInfo.from_hash(raw).takes_own_queue(name)
    except (KeyError, ValueError):
        return False
