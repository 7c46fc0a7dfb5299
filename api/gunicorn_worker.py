"""A gthread worker that collects request headers without holding a thread (slow-loris).

Stock gthread hands a connection to a thread as soon as its first byte arrives, and the
thread then blocks until the whole header block is in: a few dozen clients sending one
byte every few seconds hold every thread, forever (measured: 30 such sockets stalled a
2 x 32-thread API; none was ever closed). Here a thread only takes what the socket already
holds, without blocking; until the blank line that ends the headers has arrived, the
connection goes back to the worker's poller (gunicorn's deferred connections), and a
connection whose headers take longer than HEADER_TIMEOUT_SECONDS in all is closed
(docs/faults.md, F15). A body with a Content-Length up to MAX_BUFFERED_BODY is gathered the
same way before a thread sees the request, and one still incomplete BODY_TIMEOUT_SECONDS
after its headers is answered 408 and closed: a client trickling its body one byte a second
holds no thread. Chunked and larger bodies (file uploads) are read by the
thread, as stock gthread does.

A deferred connection waits for these deadlines, not for gunicorn's `keepalive` (5 s),
which gunicorn gives every deferred connection: a client that connected during a burst and
sent its request 5 s later found the connection closed (measured: 1-2 of F10's 200
simultaneous clients, "Server disconnected" or "Connection reset by peer"). Kept-alive
connections between requests still close after `keepalive` seconds.

TLS and HTTP/2 prior-knowledge connections, and gunicorn versions without deferred
connections, fall back to the stock behaviour.

gunicorn has no public API for this: the class overrides gthread's `handle`,
`finish_request` and `murder_pending` and uses its `_DEFER` verdict, `pending_conns`,
`poller`, `nr_conns`, `enqueue_req` and the connection's parser. gunicorn is pinned in
pyproject.toml, and tests/test_pinned_internals.py fails naming what an upgrade changed.
"""

from __future__ import annotations

import os
import time
from typing import Any

from gunicorn.workers import gthread

HEADER_TIMEOUT_SECONDS = float(os.environ.get("LLMQ_HEADER_TIMEOUT", "10"))
BODY_TIMEOUT_SECONDS = float(os.environ.get("LLMQ_BODY_TIMEOUT", "10"))
MAX_HEAD_BYTES = 64 * 1024  # beyond this, gunicorn's own limits reject the request
MAX_BUFFERED_BODY = 2 * 1024 * 1024  # above the API's 1 MiB limit, so 413s still come fast
HEAD_END = b"\r\n\r\n"
TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
_DEFER = getattr(gthread, "_DEFER", None)


class HeaderDeadlineWorker(gthread.ThreadWorker):
    def handle(self, conn: Any) -> Any:
        if _DEFER is None or self.cfg.is_ssl or self._prior_knowledge(conn):
            return super().handle(conn)
        verdict = self._gather_head(conn)
        if verdict is not None:
            return verdict
        return super().handle(conn)

    def _prior_knowledge(self, conn: Any) -> bool:
        try:
            from gunicorn.http2 import negotiation  # only in gunicorn versions with HTTP/2
        except ImportError:
            return False
        return bool(negotiation.prior_knowledge_allowed(self.cfg, conn.client))

    def finish_request(self, conn: Any, fs: Any) -> None:
        super().finish_request(conn, fs)
        deadline = getattr(conn, "llmq_deadline", 0.0)
        if deadline and self.pending_conns and self.pending_conns[-1] is conn:
            conn.timeout = deadline  # deferred by _gather_head: its own deadline

    def murder_pending(self) -> None:
        """Deferred connections past their deadline go to a thread, where `_gather_head`
        reads what came, answers a late body 408 and closes (closing here, with bytes
        unread, would reset the connection and lose the 408). gunicorn's own stops at the
        first one not yet due, as its deadlines come in arrival order; these do not (a
        connection keeps its first deadline however often it is deferred)."""
        now = time.monotonic()
        for conn in [c for c in self.pending_conns if c.timeout <= now]:
            self.pending_conns.remove(conn)
            try:
                self.poller.unregister(conn.sock)
            except (OSError, KeyError, ValueError):
                pass  # already unregistered
            if getattr(conn, "llmq_deadline", 0.0):
                self.enqueue_req(conn)
            else:  # deferred by stock gthread (TLS, HTTP/2): closed as gunicorn does
                self.nr_conns -= 1
                conn.close()

    @staticmethod
    def _answer_timed_out(conn: Any) -> None:
        try:
            conn.sock.send(TIMED_OUT)
        except OSError:
            pass

    @staticmethod
    def _drop(conn: Any) -> bool:
        """Close now, here: gunicorn's graceful close lingers up to 2 s reading what the
        client still sends, on the worker's main loop, which a slow client would stall."""
        try:
            conn.sock.close()
        except OSError:
            pass
        return False

    def _gather_head(self, conn: Any) -> Any:
        """None when the request is ready for a thread (its headers complete, and its body
        too when it has a small Content-Length), else a verdict: `_DEFER` (wait in the poller
        for more) or False (close the connection)."""
        buffered = conn.parser.unreader.buf.getvalue() if conn.parser is not None else b""
        if HEAD_END in buffered:
            return None  # a pipelined request that is already complete
        data: bytes = getattr(conn, "llmq_head", b"")
        deadline: float = getattr(conn, "llmq_deadline", 0.0) or (
            time.monotonic() + HEADER_TIMEOUT_SECONDS
        )
        conn.sock.setblocking(False)
        while not _ready(buffered + data):
            try:
                chunk = conn.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                return self._drop(conn)
            if not chunk:
                return self._drop(conn)  # the client closed before finishing its request
            if HEAD_END not in buffered + data and HEAD_END in buffered + data + chunk:
                deadline = time.monotonic() + BODY_TIMEOUT_SECONDS  # the body's own budget
            data += chunk
        if _ready(buffered + data):
            conn.llmq_head, conn.llmq_deadline = b"", 0.0
            if conn.parser is None:
                conn.init()  # blocking socket and an HTTP/1 parser
            rest = conn.parser.unreader.take_buffered()
            conn.parser.unreader.unread(rest + data)
            return None
        if time.monotonic() > deadline:
            slow = "body" if HEAD_END in buffered + data else "headers"
            self.log.debug("closing %s: request %s too slow", conn.client, slow)
            if slow == "body":
                self._answer_timed_out(conn)
            return self._drop(conn)
        conn.llmq_head, conn.llmq_deadline = data, deadline
        return _DEFER


def _ready(data: bytes) -> bool:
    """Whether a thread may take the request: its headers are in (or too long: gunicorn
    rejects them), and so is its body unless it is chunked, absent or large."""
    head, found, body = data.partition(HEAD_END)
    if not found:
        return len(data) >= MAX_HEAD_BYTES
    length = _content_length(head)
    return length is None or length > MAX_BUFFERED_BODY or len(body) >= length


def _content_length(head: bytes) -> int | None:
    """The one Content-Length of a request without Transfer-Encoding or Expect, else None
    (the thread and gunicorn's parser judge those, and malformed ones)."""
    lengths = []
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name in (b"transfer-encoding", b"expect"):
            return None  # chunked; or a client waiting for gunicorn's 100 Continue
        if name == b"content-length":
            lengths.append(value.strip())
    if len(lengths) != 1 or not lengths[0].isdigit():
        return None
    return int(lengths[0])
