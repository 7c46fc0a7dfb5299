"""XREAD's reply as Redis sent it, for the stream readers (api/streams/stream_hub.py).

redis-py's reply callback for XREAD rebuilds every entry's fields into a dict, which cost
the API a tenth of its relay CPU at 1,000 streams (bench/fleet.py); the readers decode the
flat field list themselves (`workers.wire.events.decode`), so they ask without it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import redis

# `xread(streams, count, block)`: XREAD COUNT count BLOCK block STREAMS streams' keys and ids
XRead = Callable[[dict[str, str], int, int], Any]


def xread_args(streams: dict[str, str], count: int, block: int) -> list[Any]:
    """XREAD's arguments for `streams` (key -> the id to read after)."""
    return ["XREAD", "COUNT", count, "BLOCK", block, "STREAMS", *streams, *streams.values()]


def raw_xread(client: redis.Redis) -> XRead:
    """`XREAD COUNT n BLOCK ms STREAMS ...` on one Redis, answered as Redis sent it (RESP3: a
    map of key to entries; RESP2: a list of [key, entries]; an entry's fields a flat list):
    a copy of `client` (its connection pool and settings) with its own callbacks, XREAD's
    left out, asks."""
    raw = copy.copy(client)
    raw.response_callbacks = type(client.response_callbacks)(client.response_callbacks)
    raw.response_callbacks.pop("XREAD", None)

    def xread(streams: dict[str, str], count: int, block: int) -> Any:
        return raw.execute_command(*xread_args(streams, count, block))

    return xread
