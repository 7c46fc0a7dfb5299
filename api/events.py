"""Following a job's event stream, and noticing clients that went away.

The stream (`keys.job_events`) is the only source of truth for what a client may see
(docs/faults.md L7): readers XREAD it from an entry id, so a late or reconnecting reader gets
every later event exactly once. XREAD BLOCK wakes us as soon as a worker appends; the block
is shorter than the Redis socket timeout, and each empty wait is reported to the caller as an
idle tick (for pings, disconnect checks and lost-job checks).
"""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis

from api.errors import InvalidRequest
from workers import keys
from workers.wire.errors import cancelled_error, error_body
from workers.wire.events import StreamDone, StreamError, StreamEvent, decode, is_terminal
from workers.wire.job import FAILED, FINISHED, TERMINAL_STATUSES
from workers.wire.text import as_str

BLOCK_MS = 500  # below the client's 2 s socket timeout, short enough to notice disconnects
LOST_GRACE_SECONDS = 5.0  # a terminal record without a terminal event after this is repaired
STREAM_ID = re.compile(r"^\d{1,20}(-\d{1,20})?$")


@dataclass
class Event:
    """A job event as a reader meets it: its stream entry id (the SSE `id:`) and what it says."""

    id: str
    message: StreamEvent

    @property
    def kind(self) -> str:
        return self.message.kind

    @property
    def terminal(self) -> bool:
        return is_terminal(self.message)


def parse_event_id(value: str | None, name: str = "Last-Event-ID") -> str:
    """A client-supplied stream entry id; "0" (from the start) when absent."""
    if value is None or value == "":
        return "0"
    if not STREAM_ID.match(value):
        raise InvalidRequest(f"{name} must be a stream entry id such as 1700000000000-0.")
    return value


def follow(conn: redis.Redis, job_id: str, after: str = "0") -> Iterator[Event | None]:
    """Events after `after`, ending with the terminal one; None for each idle wait.

    If the job's record vanishes (expired, or Redis lost it) or is terminal without a
    terminal event in the stream, a synthesized terminal event ends the iteration instead
    of leaving the reader waiting forever (docs/faults.md F8).
    """
    stream = keys.job_events(job_id)
    last = after
    idle_since = time.monotonic()
    while True:
        reply = conn.xread({stream: last}, count=256, block=BLOCK_MS)
        if not reply:
            yield None
            repaired = _repair(conn, job_id, last, time.monotonic() - idle_since)
            if repaired is not None:
                yield repaired
                return
            continue
        idle_since = time.monotonic()
        for entry_id, fields in reply[0][1]:
            last = as_str(entry_id)
            event = Event(last, decode(fields))
            yield event
            if event.terminal:
                return


def _repair(conn: redis.Redis, job_id: str, last: str, idle: float) -> Event | None:
    raw = conn.hmget(keys.job(job_id), ["status", "result", "error"])
    status = as_str(raw[0]) if raw[0] is not None else None
    if status is None:
        error = error_body(
            f"Job {job_id} no longer exists (expired or lost).",
            code="job_lost",
            status=404,
        )
        return Event(last, StreamError.from_data(error))
    if status in TERMINAL_STATUSES and idle >= LOST_GRACE_SECONDS:
        if status == FINISHED and raw[1] is not None:
            return Event(last, StreamDone.from_data(_json(raw[1])))
        if status == FAILED and raw[2] is not None:
            return Event(last, StreamError.from_data(_json(raw[2])))
        return Event(last, StreamError.from_data(cancelled_error()))
    return None


def client_gone(environ: dict[str, Any]) -> bool:
    """Whether the client closed its connection, by peeking at the socket without blocking.

    WSGI offers no disconnect signal while a response is pending; gunicorn and werkzeug both
    expose the socket in the environ, and a readable socket with nothing to read is closed.
    """
    sock = environ.get("gunicorn.socket") or environ.get("werkzeug.socket")
    if sock is None:
        return False
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):  # reset/closed; ValueError: TLS sockets refuse flags
        return not _is_tls(sock)
    return data == b""


class DisconnectWatch:
    """`client_gone` at most every `interval` seconds, so busy streams check it cheaply too."""

    def __init__(self, environ: dict[str, Any], interval: float = 0.25) -> None:
        self.environ = environ
        self.interval = interval
        self.checked = time.monotonic()

    def gone(self) -> bool:
        now = time.monotonic()
        if now - self.checked < self.interval:
            return False
        self.checked = now
        return client_gone(self.environ)


def _is_tls(sock: Any) -> bool:
    return hasattr(sock, "getpeercert")


def sse(data: str, *, event: str | None = None, id: str | None = None) -> str:
    """One SSE message; multi-line data is split into several `data:` lines."""
    lines = []
    if id is not None:
        lines.append(f"id: {id}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.extend(f"data: {line}" for line in data.split("\n"))
    return "\n".join(lines) + "\n\n"


SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: flush each event, do not buffer the stream
}


def _json(raw: bytes | str) -> dict[str, Any]:
    return json.loads(raw)
