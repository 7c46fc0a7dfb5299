"""A gthread worker that collects request headers without holding a thread (slow-loris).

Stock gthread hands a connection to a thread as soon as its first byte arrives, and the
thread then blocks until the whole header block is in: a few dozen clients sending one
byte every few seconds hold every thread, forever (measured: 30 such sockets stalled a
2 x 32-thread API; none was ever closed). Here a thread only takes what the socket already
holds, without blocking; until the blank line that ends the headers has arrived, the
connection goes back to the worker's poller (gunicorn's deferred connections, which it
closes after `keepalive` seconds of silence), and a connection whose headers take longer
than HEADER_TIMEOUT_SECONDS in all is closed (RELIABILITY F15).

TLS and HTTP/2 prior-knowledge connections, and gunicorn versions without deferred
connections, fall back to the stock behaviour.
"""

from __future__ import annotations

import os
import time
from typing import Any

from gunicorn.workers import gthread

HEADER_TIMEOUT_SECONDS = float(os.environ.get("LLMQ_HEADER_TIMEOUT", "10"))
MAX_HEAD_BYTES = 64 * 1024  # beyond this, gunicorn's own limits reject the request
HEAD_END = b"\r\n\r\n"
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
        """None when the headers are complete (handed to the parser), else a verdict:
        `_DEFER` (wait in the poller for more) or False (close the connection)."""
        buffered = conn.parser.unreader.buf.getvalue() if conn.parser is not None else b""
        if HEAD_END in buffered:
            return None  # a pipelined request that is already complete
        head: bytes = getattr(conn, "llmq_head", b"")
        deadline: float = getattr(conn, "llmq_deadline", 0.0) or (
            time.monotonic() + HEADER_TIMEOUT_SECONDS
        )
        conn.sock.setblocking(False)
        while len(head) < MAX_HEAD_BYTES:
            try:
                chunk = conn.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                return self._drop(conn)
            if not chunk:
                return self._drop(conn)  # the client closed before finishing its headers
            head += chunk
        if HEAD_END in buffered + head or len(head) >= MAX_HEAD_BYTES:
            conn.llmq_head, conn.llmq_deadline = b"", 0.0
            if conn.parser is None:
                conn.init()  # blocking socket and an HTTP/1 parser
            rest = conn.parser.unreader.take_buffered()
            conn.parser.unreader.unread(rest + head)
            return None
        if time.monotonic() > deadline:
            self.log.debug("closing %s: request headers too slow", conn.client)
            return self._drop(conn)
        conn.llmq_head, conn.llmq_deadline = head, deadline
        return _DEFER
