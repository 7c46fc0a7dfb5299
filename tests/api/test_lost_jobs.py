"""api/streams/lost_jobs.py: the terminal event a waiting client gets when its job will send none
(docs/faults.md F8), and only once nothing more is in the job's stream."""

from __future__ import annotations

import json
from dataclasses import dataclass

import fakeredis

from api.streams.lost_jobs import LOST_GRACE_SECONDS, find_lost, repair
from workers import keys
from workers.wire.errors import cancelled_error
from workers.wire.events import StreamDone, StreamError, event_fields, token_event
from workers.wire.job import CANCELLED, FAILED, FINISHED, STARTED

LATE = LOST_GRACE_SECONDS + 1


def test_a_job_whose_record_is_gone_is_lost_at_once() -> None:
    event = repair("gone", [None, None, None], 0.0)
    assert isinstance(event, StreamError) and event.error["code"] == "job_lost"


def test_an_ended_record_stands_for_the_missing_terminal_event_after_the_grace() -> None:
    result = {"id": "cmpl", "choices": []}
    error = {"error": {"message": "boom", "type": "server_error", "code": "x"}}
    assert repair("j", [FINISHED.encode(), json.dumps(result).encode(), None], 1.0) is None
    assert repair("j", [FINISHED.encode(), json.dumps(result), None], LATE) == StreamDone(result)
    assert repair("j", [FAILED, None, json.dumps(error)], LATE) == StreamError.from_data(error)
    cancelled = StreamError.from_data(cancelled_error())
    assert repair("j", [CANCELLED, None, None], LATE) == cancelled


def test_a_running_job_is_never_repaired() -> None:
    assert repair("j", [STARTED, None, None], 3600.0) is None


@dataclass
class _Waiting:
    job_id: str
    last: str = "0"

    @property
    def key(self) -> str:
        return keys.job_events(self.job_id)


def test_only_a_stream_with_nothing_after_the_followers_last_event_is_repaired() -> None:
    conn = fakeredis.FakeRedis()
    token = event_fields(token_event(0, 0, "t ", 0, None, None, 1))
    seen = {}
    for job_id in ("ended", "unread"):
        conn.hset(keys.job(job_id), mapping={"status": FINISHED, "result": '{"id": "x"}'})
        seen[job_id] = conn.xadd(keys.job_events(job_id), token).decode()
    conn.xadd(keys.job_events("unread"), token)  # one more after the follower's last
    ended, unread = _Waiting("ended", seen["ended"]), _Waiting("unread", seen["unread"])
    gone, running = _Waiting("gone"), _Waiting("running")
    conn.hset(keys.job("running"), "status", STARTED)
    idle = [(ended, LATE), (unread, LATE), (gone, 0.0), (running, LATE)]
    lost = find_lost(conn, conn, idle)
    assert [(w.job_id, type(e).__name__) for w, e in lost] == [
        ("ended", "StreamDone"),
        ("gone", "StreamError"),
    ]
