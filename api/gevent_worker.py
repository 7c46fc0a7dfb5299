"""The API's gunicorn worker: gevent, so a connection is a greenlet, not a thread.

A waiting stream then costs kilobytes (its greenlet and a `Follower`, api/streams/stream_hub.py)
where gthread's cost a thread each: 2 x 32 threads relayed 64 streams at a time and left
the rest without headers for up to a minute. gunicorn's gevent worker patches the standard
library when the process starts, before the app is imported, so redis-py's sockets and
`BoundedPool`'s waits are cooperative too.

The slow-client deadlines of the gthread worker (api/gunicorn_worker.py, docs/faults.md F15)
are kept: a slow client holds only a greenlet here, but it must still be closed.
- A new connection's first request has HEADER_TIMEOUT_SECONDS for its headers (gevent's
  worker gives it gunicorn's `keepalive`, 5 s, which closed F10's clients that connected in
  a burst and sent their request later); later requests on a kept-alive connection keep
  `keepalive`.
- A body with a Content-Length up to MAX_BUFFERED_BODY is read before the app runs, within
  BODY_TIMEOUT_SECONDS, else answered 408 and closed. Chunked, larger and `Expect:
  100-continue` bodies are the app's to read, as in stock gunicorn.

Uses gunicorn's `timeout_ctx` and `handle_request` hooks and the parsed request's body
reader (pinned in pyproject.toml; tests/test_pinned_internals.py).
"""

from __future__ import annotations

import io
from typing import Any

import gevent
from gevent.local import local
from gunicorn.http.body import Body, LengthReader
from gunicorn.workers.ggevent import GeventWorker

from api.gunicorn_worker import (
    BODY_TIMEOUT_SECONDS,
    HEADER_TIMEOUT_SECONDS,
    MAX_BUFFERED_BODY,
    TIMED_OUT,
)


class BodyTooSlow(StopIteration):
    """Ends the connection (gunicorn's handler closes it on StopIteration) after the 408."""


class StreamingWorker(GeventWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._connection = local()  # per greenlet: is the next request its first?

    def handle(self, listener: Any, client: Any, addr: Any) -> None:
        self._connection.first = True
        super().handle(listener, client, addr)

    def timeout_ctx(self) -> gevent.Timeout:
        """Bounds the wait for a request's headers (gunicorn's keep-alive loop)."""
        if getattr(self._connection, "first", False):
            self._connection.first = False
            return gevent.Timeout(HEADER_TIMEOUT_SECONDS, False)
        return super().timeout_ctx()

    def handle_request(self, listener_name: Any, req: Any, sock: Any, addr: Any) -> Any:
        if not self._gather_body(req):
            self.log.debug("closing %s: request body too slow", addr)
            try:
                sock.sendall(TIMED_OUT)
            except OSError:
                pass
            raise BodyTooSlow()
        return super().handle_request(listener_name, req, sock, addr)

    @staticmethod
    def _gather_body(req: Any) -> bool:
        """Read a small Content-Length body now, within its deadline; False if it did not
        come in time. The app then reads it from memory."""
        reader = getattr(req.body, "reader", None)
        if not isinstance(reader, LengthReader) or not 0 < reader.length <= MAX_BUFFERED_BODY:
            return True
        if any(name == "EXPECT" for name, _ in req.headers):
            return True  # the client waits for gunicorn's 100 Continue before sending it
        data = None
        with gevent.Timeout(BODY_TIMEOUT_SECONDS, False):
            data = req.body.read()
        if data is None:
            return False
        req.body = Body(io.BytesIO(data))
        return True
