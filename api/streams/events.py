"""Following a job's event stream, and noticing clients that went away.

The stream (`keys.job_events`) is the only source of truth for what a client may see
(docs/faults.md L7): readers get it from an entry id, so a late or reconnecting reader gets
every later event exactly once. The reading itself is the process's `StreamHub`'s (one
XREAD for every waiting client, api/streams/stream_hub.py); a follower waits for what it hands out,
and each wait that ends empty is reported to the caller as an idle tick (for pings,
disconnect checks and deadlines).
"""

from __future__ import annotations

import contextlib
import re
import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

from api.errors import InvalidRequest
from api.streams.stream_hub import Event, StreamHub

__all__ = [
    "Event",
    "follow",
    "follow_batches",
    "parse_event_id",
    "client_gone",
    "DisconnectWatch",
    "sse",
]

THREAD_TICK = 0.5  # threads peek at the client's socket this often while idle
GREEN_TICK = 5.0  # greenlets are woken by the socket itself (DisconnectWatch.attach)
STREAM_ID = re.compile(r"^\d{1,20}(-\d{1,20})?$")


def cooperative() -> bool:
    """Whether this process runs greenlets (gunicorn's gevent worker patched the socket)."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("socket"))


def idle_tick(ping: float) -> float:
    """How long a follower waits before an idle tick: at most `ping`."""
    return min(ping, GREEN_TICK if cooperative() else THREAD_TICK)


def parse_event_id(value: str | None, name: str = "Last-Event-ID") -> str:
    """A client-supplied stream entry id; "0" (from the start) when absent."""
    if value is None or value == "":
        return "0"
    if not STREAM_ID.match(value):
        raise InvalidRequest(f"{name} must be a stream entry id such as 1700000000000-0.")
    return value


def follow_batches(
    hub: StreamHub,
    job_id: str,
    after: str = "0",
    *,
    tick: float = THREAD_TICK,
    watch: DisconnectWatch | None = None,
) -> Iterator[list[Event]]:
    """`follow`'s events as the hub handed them out together, the last batch ending with
    the terminal event; an empty list for each idle tick. A stream that fell behind then
    sends what it owes in one write, not one per token."""
    follower = hub.follow(job_id, after)
    if watch is not None:
        watch.attach(follower.wake)
    try:
        while True:
            events = follower.take(tick)
            for i, event in enumerate(events):
                if event.terminal:
                    yield events[: i + 1]
                    return
            yield events
    finally:
        if watch is not None:
            watch.detach()
        hub.leave(follower)


def follow(
    hub: StreamHub,
    job_id: str,
    after: str = "0",
    *,
    tick: float = THREAD_TICK,
    watch: DisconnectWatch | None = None,
) -> Iterator[Event | None]:
    """Events after `after`, ending with the terminal one; None for each idle tick (a wait
    of `tick` seconds, or a wake by `watch` when the client's socket turned readable).

    If the job's record vanishes (expired, or Redis lost it) or is terminal without a
    terminal event in the stream, a synthesized terminal event ends the iteration instead
    of leaving the reader waiting forever (docs/faults.md F8). Raises the Redis error that
    stopped the hub's reader.
    """
    with contextlib.closing(follow_batches(hub, job_id, after, tick=tick, watch=watch)) as batches:
        for batch in batches:
            if not batch:
                yield None
            yield from batch


def client_gone(environ: dict[str, Any]) -> bool:
    """Whether the client closed its connection, by peeking at the socket without blocking.

    WSGI offers no disconnect signal while a response is pending; gunicorn and werkzeug both
    expose the socket in the environ, and a readable socket with nothing to read is closed.
    """
    sock = _socket(environ)
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
    """`client_gone` at most every `interval` seconds, so busy streams check it cheaply too.

    Under gevent, `attach` asks the event loop to say when the client's socket turns
    readable (a closed socket does; an idle live one does not), so thousands of idle
    streams cost no periodic peeks: `gone` then peeks only once signalled, and falls back
    to the interval if a live client sent bytes (a pipelined request)."""

    def __init__(self, environ: dict[str, Any], interval: float = 0.25) -> None:
        self.environ = environ
        self.interval = interval
        self.checked = time.monotonic()
        self._io: Any = None
        self._signalled = False

    def attach(self, wake: Any) -> None:
        sock = _socket(self.environ)
        if sock is None or not cooperative() or _is_tls(sock):
            return
        from gevent import get_hub

        self._io = get_hub().loop.io(sock.fileno(), 1)
        self._io.start(self._readable, wake)

    def _readable(self, wake: Any) -> None:
        import gevent

        self._signalled = True
        self.detach()  # once: a live client's unread bytes would signal it again and again
        gevent.spawn(wake.set)  # not in the event loop's own greenlet, where nothing may wait

    def detach(self) -> None:
        if self._io is not None:
            self._io.stop()
            self._io.close()
            self._io = None

    def gone(self) -> bool:
        if self._io is not None:
            return False  # not signalled yet: the socket is open and quiet
        now = time.monotonic()
        if not self._signalled and now - self.checked < self.interval:
            return False
        self._signalled, self.checked = False, now
        return client_gone(self.environ)


def _socket(environ: dict[str, Any]) -> Any:
    """The client's socket; under gevent its plain one (gevent's `recv` would wait where
    MSG_DONTWAIT asks it not to)."""
    sock = environ.get("gunicorn.socket") or environ.get("werkzeug.socket")
    return getattr(sock, "_sock", sock)


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
