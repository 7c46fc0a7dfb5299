"""Wake tokens: how a job put on a queue wakes an idle worker at once."""

from __future__ import annotations

from typing import Any

from workers.wire.defaults import WAKE_MAX_TOKENS, WAKE_TTL_SECONDS

WAKE_TOKEN = "1"


def push_wake(pipe: Any, wake_key: str) -> None:
    """Queue on `pipe` a wake token for `keys.queue_wake(queue)`, right after putting a job
    on that queue (in the same transaction, so a worker woken by the token finds the job).

    An idle worker blocks on the wake lists of its queues (`workers.presence`) and claims
    at once when one is pushed, instead of at the end of its poll interval. Tokens carry no
    data: a worker that finds the queue empty (someone else took the job) just waits again.
    """
    pipe.lpush(wake_key, WAKE_TOKEN)
    pipe.ltrim(wake_key, 0, WAKE_MAX_TOKENS - 1)
    pipe.expire(wake_key, WAKE_TTL_SECONDS)
