"""The terminal event a waiting client gets when its job will send none (docs/faults.md F8).

The stream stays the only source of truth (docs/faults.md L7), but a job whose record
vanished (expired, flushed) or that ended without a terminal event in its stream (its
worker died between the two) would keep its clients waiting forever. The stream readers
(api/streams/stream_hub.py) hand their idle followers to `find_lost` now and then; each gets the
event its job's record stands for, and only once nothing more is in its stream.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import redis

from workers import keys
from workers.wire.errors import cancelled_error, error_body
from workers.wire.events import StreamDone, StreamError, StreamEvent
from workers.wire.job import FAILED, FINISHED, TERMINAL_STATUSES
from workers.wire.text import as_str

LOST_GRACE_SECONDS = 5.0  # a terminal record without a terminal event after this is repaired
CHECK_BATCH = 500  # job records read per pipeline in a check


class Waiting(Protocol):
    """A client's place in a job's stream, as a check needs it (`stream_hub.Follower`)."""

    job_id: str
    key: str  # the job's stream
    last: str  # the id of the last event it got


W = TypeVar("W", bound=Waiting)


def find_lost(
    conn: redis.Redis, events: Any, idle: Sequence[tuple[W, float]]
) -> list[tuple[W, StreamEvent]]:
    """The terminal event each of the `idle` followers (with the seconds each has waited)
    should get now: its job's record (on `conn`) is gone, or terminal for
    LOST_GRACE_SECONDS, and its stream (on `events`) holds nothing after its last event.
    Two pipelines a CHECK_BATCH of followers; a stream with more is left to the next XREAD
    (a job may have ended after the last one: its events are then in the stream)."""
    lost = []
    for start in range(0, len(idle), CHECK_BATCH):
        batch = idle[start : start + CHECK_BATCH]
        with conn.pipeline(transaction=False) as pipe:
            for follower, _ in batch:
                pipe.hmget(keys.job(follower.job_id), ["status", "result", "error"])
            records = pipe.execute()
        repairs = []
        for (follower, waited), raw in zip(batch, records, strict=True):
            message = repair(follower.job_id, raw, waited)
            if message is not None:
                repairs.append((follower, message))
        if not repairs:
            continue
        with events.pipeline(transaction=False) as pipe:
            for follower, _ in repairs:
                pipe.xrange(follower.key, min=f"({follower.last}", count=1)
            pending = pipe.execute()
        lost += [repaired for repaired, more in zip(repairs, pending, strict=True) if not more]
    return lost


def repair(job_id: str, raw: list[Any], idle: float) -> StreamEvent | None:
    """The terminal event a follower idle for `idle` seconds should get, given its job
    record's `status`, `result` and `error` fields (`raw`); None while it should wait."""
    status = as_str(raw[0]) if raw[0] is not None else None
    if status is None:
        error = error_body(
            f"Job {job_id} no longer exists (expired or lost).",
            code="job_lost",
            status=404,
        )
        return StreamError.from_data(error)
    if status in TERMINAL_STATUSES and idle >= LOST_GRACE_SECONDS:
        if status == FINISHED and raw[1] is not None:
            return StreamDone.from_data(json.loads(raw[1]))
        if status == FAILED and raw[2] is not None:
            return StreamError.from_data(json.loads(raw[2]))
        return StreamError.from_data(cancelled_error())
    return None
