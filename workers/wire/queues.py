"""llmq's RQ queues as RQ registers them: the names in RQ's set of queue keys that are
llmq's (shared, own and priority-level queues all start `llmq-`), and how many jobs wait on
each. The API's /metrics and queue listings and the workers' history samples all read them
so, one round trip for the lengths."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rq import Queue

from workers import keys
from workers.wire.text import as_str

_KEY_PREFIX = Queue.redis_queue_namespace_prefix  # an RQ queue's key is this + its name


def llmq_queue_names(queue_keys: Iterable[bytes | str]) -> list[str]:
    """The names of llmq's queues among RQ's queue keys (`Queue.redis_queues_keys`), sorted."""
    ours = _KEY_PREFIX + keys.PREFIX + "-"
    return sorted(as_str(k)[len(_KEY_PREFIX) :] for k in queue_keys if as_str(k).startswith(ours))


def queue_lengths(conn: Any, names: list[str]) -> dict[str, int]:
    """How many job ids wait on each named queue, in one pipeline."""
    if not names:
        return {}
    with conn.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.llen(_KEY_PREFIX + name)
        return dict(zip(names, (int(n) for n in pipe.execute()), strict=True))
