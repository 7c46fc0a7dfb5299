"""The one SSE relay: a job's events to one waiting client, however the surface shows them.

Every stream of the API (a streamed chat or completion, api/flow.py; a job's `/events`,
api/jobs.py; a response's events, api/responses/routes.py) is this loop, and each surface
gives only a `Renderer`: what goes out first, how a batch of events looks, how an error
ends the stream. What the contract promises of every stream (docs/contract.md, "Streams at
scale") is kept here once:

- the headers go out at once: the first write is the renderer's start, even an empty one;
- `: ping` comments while the job waits, at most every `PING_SECONDS`;
- a client resumes from an entry id (`after`: Last-Event-ID, `?after=`);
- a client that hangs up (its socket closed, or a write failed) stops the relay, and
  `on_hang_up` runs (a foreground job is cancelled; an async job's listener cancels nothing);
- a failure ends the stream in-band with one error, mapped by `stream_error`: the API's
  own error as it is, an exhausted connection pool as `redis_pool_exhausted`, Redis
  unreachable as `broker_down`, anything else as a logged `server_error`.

A job that will send no terminal event gets one from the hub (api/streams/lost_jobs.py),
which the renderer shows as any other end.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Protocol

import redis
from flask import Response, current_app, request

from api.config import stream_hub
from api.errors import APIError, InternalError, ServiceUnavailable, pool_exhausted
from api.streams.events import SSE_HEADERS, DisconnectWatch, follow_batches, idle_tick
from api.streams.stream_hub import Event, StreamHub
from workers.wire.broker import PoolExhausted

log = logging.getLogger(__name__)

PING = ": ping\n\n"


class Renderer(Protocol):
    """How one surface shows its stream; it holds that stream's own state (chunk ids,
    sequence numbers)."""

    def start(self) -> str:
        """What goes out before any event ("" still sends the headers now)."""
        ...

    def events(self, batch: list[Event]) -> str:
        """The SSE text of events the hub handed out together ("" when none is shown)."""
        ...

    def error(self, error: APIError) -> str:
        """The in-band end of a stream that failed (after it, nothing more is sent)."""
        ...


def stream_error(exc: Exception) -> APIError:
    """The error a stream tells its client in-band for `exc`. As the app's error handlers
    (api/errors.py) answer a request: a pool that stayed busy (`PoolExhausted`, or a capped
    Sentinel pool's `MaxConnectionsError`) is 503 `redis_pool_exhausted`, never
    `broker_down`; any other Redis error reaching a stream means the hub's reader lost Redis
    (api/streams/stream_hub.py retries a late reply before it says so): `broker_down`."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PoolExhausted | redis.exceptions.MaxConnectionsError):
        return pool_exhausted()
    if isinstance(exc, redis.RedisError):
        return ServiceUnavailable("The job broker is unavailable.", code="broker_down")
    return InternalError()


def relay(
    hub: StreamHub,
    job_id: str,
    renderer: Renderer,
    *,
    ping: float,
    after: str = "0",
    watch: DisconnectWatch | None = None,
    on_hang_up: Callable[[], None] | None = None,
    on_end: Callable[[], None] | None = None,
) -> Iterator[str]:
    """The SSE text of `job_id`'s events after `after`, rendered by `renderer`, with a
    `: ping` after `ping` seconds without a write. `on_end` runs once the terminal event was
    rendered (a failure in it ends the stream with an error, as any other); `on_hang_up`
    when the client went away before the end (`watch` saw its socket close, or the server
    closed this generator because a write failed)."""
    finished = False
    last_sent = time.monotonic()
    try:
        yield renderer.start()  # the server sends the headers at the first write
        batches = follow_batches(hub, job_id, after, tick=idle_tick(ping), watch=watch)
        with contextlib.closing(batches):  # leaves the hub at once, however this ends
            for batch in batches:
                if watch is not None and watch.gone():
                    return  # the finally clause tells on_hang_up
                if not batch:
                    if time.monotonic() - last_sent >= ping:
                        last_sent = time.monotonic()
                        yield PING
                    continue
                out = renderer.events(batch)
                finished = batch[-1].terminal  # before the write: a failed one is no hang-up
                if out:  # what arrived together goes out in one write
                    last_sent = time.monotonic()
                    yield out
        finished = True
        if on_end is not None:
            on_end()
    except Exception as exc:  # said in-band; the job may still run, a client may resume
        finished = True
        error = stream_error(exc)
        if isinstance(error, InternalError):
            log.exception("SSE stream of job %s failed", job_id)
        yield renderer.error(error)
    finally:
        if not finished and on_hang_up is not None:
            on_hang_up()


def sse_response(
    job_id: str,
    renderer: Renderer,
    *,
    after: str = "0",
    on_hang_up: Callable[[], None] | None = None,
    on_end: Callable[[], None] | None = None,
) -> Response:
    """`relay` for the current request, as a `text/event-stream` response: the process's
    hub, `PING_SECONDS`, and a watch on this request's socket (read now: the generator runs
    outside the request context)."""
    events = relay(
        stream_hub(),
        job_id,
        renderer,
        ping=current_app.config["PING_SECONDS"],
        after=after,
        watch=DisconnectWatch(request.environ),
        on_hang_up=on_hang_up,
        on_end=on_end,
    )
    return Response(events, mimetype="text/event-stream", headers=SSE_HEADERS)
