"""A Redis set read together with one reply per member: the running jobs and their leases,
the registered workers and their hashes, the active batches and their records."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workers.wire.text import as_str


def each_member(conn: Any, set_key: str, ask: Callable[[Any, str], Any]) -> list[tuple[str, Any]]:
    """(member, reply) for each member of the set `set_key`, where `ask(pipe, member)` queues
    one command per member on a pipeline: two round trips however large the set is."""
    members = [as_str(m) for m in conn.smembers(set_key)]
    if not members:
        return []
    with conn.pipeline(transaction=False) as pipe:
        for member in members:
            ask(pipe, member)
        replies = pipe.execute()
    return list(zip(members, replies, strict=True))
