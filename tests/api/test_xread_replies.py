"""api/streams/xread_replies.py: the stream readers' XREAD answered as Redis sent it, while the
client it was copied from keeps redis-py's own reply."""

from __future__ import annotations

import pytest
import redis

from api.streams.xread_replies import raw_xread, xread_args
from workers import keys
from workers.wire.events import decode, event_fields, token_event

pytestmark = pytest.mark.integration


def test_the_arguments_name_every_key_then_every_id() -> None:
    args = xread_args({"a": "0", "b": "5-1"}, 256, 1000)
    assert args == ["XREAD", "COUNT", 256, "BLOCK", 1000, "STREAMS", "a", "b", "0", "5-1"]


def test_entries_come_back_as_flat_field_lists_and_the_client_is_left_as_it_was(
    real_redis: redis.Redis,
) -> None:
    key = keys.job_events("raw")
    fields = event_fields(token_event(0, 0, "t ", 0, None, None, 1))
    entry = real_redis.xadd(key, fields)
    reply = raw_xread(real_redis)({key: "0"}, 5, 10)
    [[read_key, [(read_id, flat)]]] = reply.items() if isinstance(reply, dict) else reply
    assert (read_key, read_id) == (key.encode(), entry)
    assert isinstance(flat, list) and decode(flat).kind == "token"
    [[_, [(_, parsed)]]] = real_redis.xread({key: "0"}, count=5)
    assert isinstance(parsed, dict)  # redis-py's callback still answers the original
