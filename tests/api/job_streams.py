"""A job's event stream written as a worker writes it, for the stream tests
(test_stream_hub.py, test_relay.py)."""

from __future__ import annotations

import redis

from workers import keys
from workers.wire.events import event_fields, token_event, write_ending
from workers.wire.job import FINISHED


def add_token(conn: redis.Redis, job_id: str, index: int) -> str:
    """Token `index` ("t{index} ") on the job's stream; its entry id."""
    fields = event_fields(token_event(0, index, f"t{index} ", index, None, None, 1))
    return conn.xadd(keys.job_events(job_id), fields).decode()


def finish(conn: redis.Redis, job_id: str) -> None:
    """The job's `done` event and finished record, as a job nobody leases ends."""
    with conn.pipeline(transaction=False) as pipe:
        write_ending(pipe, job_id, FINISHED, {"id": job_id, "choices": []})
        pipe.execute()
