"""OpenAI's cursor pagination (`limit`, `after`, `has_more`) over a Redis sorted-set index
of objects whose hashes expire on their own: files, batches and jobs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis
from flask import request

from api.errors import InvalidRequest
from workers.wire.bodies import Body
from workers.wire.text import as_str


def int_arg(name: str, default: int, low: int, high: int) -> int:
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise InvalidRequest(
            f"{name} must be an integer in [{low}, {high}], got {raw!r}.", param=name
        )
    return value


def list_page(kind: type[Body], data: Sequence[Any], more: bool) -> dict[str, Any]:
    """OpenAI's cursor-paged list object around one page of objects (each with an `id`),
    built as `kind` (`JobList`, `FileList`, `BatchList`: what `/openapi.json` documents)."""
    return kind(
        object="list",
        data=list(data),
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=more,
    ).dump()


def cursor_page(
    conn: redis.Redis,
    index: str,
    key: Callable[[str], str],
    parse: Callable[[dict], Any],
    keep: Callable[[Any], bool],
    limit: int,
    after: str | None,
    ascending: bool,
) -> tuple[list[Any], bool]:
    """Cursor pagination over an index sorted set; ids whose hash expired are pruned."""
    ids = [as_str(i) for i in (conn.zrange if ascending else conn.zrevrange)(index, 0, -1)]
    if after is not None:
        ids = ids[ids.index(after) + 1 :] if after in ids else []
    found: list[Any] = []
    gone: list[str] = []
    for start in range(0, len(ids), 100):
        chunk = ids[start : start + 100]
        with conn.pipeline(transaction=False) as pipe:
            for item in chunk:
                pipe.hgetall(key(item))
            for item, raw in zip(chunk, pipe.execute(), strict=True):
                if not raw:
                    gone.append(item)
                    continue
                record = parse(raw)
                if keep(record):
                    found.append(record)
        if len(found) > limit:
            break
    if gone:
        conn.zrem(index, *gone)
    return found[:limit], len(found) > limit
