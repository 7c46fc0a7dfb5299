"""api/streams/relay.py, the one SSE relay of every stream (chat and completions, a job's
`/events`, a response's events), against a real Redis and the real `StreamHub`: the start
goes out at once, `: ping` while the job waits, a resume from an entry id, one in-band error
per failure (the hub's reader failing with each Redis error, a renderer failing), a job that
will send no terminal event ended by the hub, and a client that hangs up (its socket closed,
or a failed write closing the generator) cancelling once and only before the end."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis

from api.errors import APIError, InternalError, InvalidRequest, ServiceUnavailable
from api.jobs import JobEventRenderer
from api.streams.events import DisconnectWatch
from api.streams.relay import PING, relay, stream_error
from api.streams.stream_hub import Event, SharedReaders, StreamHub
from tests.api.job_streams import add_token, finish
from tests.api.sse import parse_text
from tests.test_imports import import_graph, module_files
from workers import keys
from workers.wire.broker import PoolExhausted

PING_SECONDS = 0.05  # the relay's idle tick is at most this
WAIT = 20.0  # bound on any one write of the relay (a busy 2-core machine)


class Recorder:
    """A renderer that writes each event's kind and keeps what it was given."""

    def __init__(self, fail_with: Exception | None = None) -> None:
        self.batches: list[list[Event]] = []
        self.errors: list[APIError] = []
        self.fail_with = fail_with

    def start(self) -> str:
        return "start\n\n"

    def events(self, batch: list[Event]) -> str:
        if self.fail_with is not None:
            raise self.fail_with
        self.batches.append(batch)
        return "".join(f"event: {e.kind}\nid: {e.id}\n\n" for e in batch)

    def error(self, error: APIError) -> str:
        self.errors.append(error)
        return f"event: error\ndata: {json.dumps(error.body())}\n\n"


class Calls:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


@pytest.fixture
def make_hub(real_redis: redis.Redis) -> Iterator[Any]:
    """`make_hub(placement=None)`: a real `StreamHub` on the test's Redis."""
    made: list[StreamHub] = []

    def make(placement: SharedReaders | None = None) -> StreamHub:
        made.append(StreamHub(real_redis, placement=placement))
        return made[-1]

    make.made = made  # type: ignore[attr-defined]
    yield make


@pytest.fixture
def pull(make_hub: Any) -> Iterator[Any]:
    """`pull(gen)`: the relay's next write, waited for in another thread and bounded: a
    relay that writes nothing for WAIT seconds fails the test (its followers are then
    failed, so that its thread comes back) instead of hanging it."""
    with ThreadPoolExecutor(max_workers=1) as pool:

        def next_write(gen: Iterator[str]) -> str | None:
            future = pool.submit(next, gen, None)
            try:
                return future.result(timeout=WAIT)
            except TimeoutError:
                for hub in make_hub.made:
                    for reader in hub.readers:
                        reader._fail_all(redis.RedisError("the test stopped waiting"))
                future.result(timeout=WAIT)
                pytest.fail(f"the relay wrote nothing for {WAIT} s")

        yield next_write


def _rest(gen: Iterator[str], pull: Any) -> list[str]:
    """Every write until the relay ends; a relay still writing (pings) after WAIT fails."""
    writes, deadline = [], time.monotonic() + WAIT
    while (write := pull(gen)) is not None:
        writes.append(write)
        assert time.monotonic() < deadline, f"the relay did not end: {writes[-5:]}"
    return writes


# ---------------------------------------------------------------- one mapping of failures


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (PoolExhausted("every connection stayed in use"), 503, "redis_pool_exhausted"),
        (redis.exceptions.MaxConnectionsError("Too many connections"), 503, "redis_pool_exhausted"),
        (redis.ConnectionError("Connection refused"), 503, "broker_down"),
        (redis.TimeoutError("Timeout reading from socket"), 503, "broker_down"),
        (redis.RedisError("the stream reader failed"), 503, "broker_down"),
        (ValueError("a bug"), 500, "internal_error"),
    ],
)
def test_each_failure_maps_to_one_in_band_error(exc: Exception, status: int, code: str) -> None:
    error = stream_error(exc)
    assert (error.status, error.body()["error"]["code"]) == (status, code)
    if code == "internal_error":
        assert "a bug" not in error.body()["error"]["message"]  # never the exception's text


def test_an_api_error_is_told_as_it_is() -> None:
    refusal = InvalidRequest("Last-Event-ID must be a stream entry id.")
    assert stream_error(refusal) is refusal


# ---------------------------------------------------------------- through the real hub


@pytest.mark.integration
def test_a_waiting_stream_starts_at_once_pings_then_relays_its_end(
    real_redis: redis.Redis, pull: Any, make_hub: Any
) -> None:
    hub, renderer, ended, hung_up = make_hub(), Recorder(), Calls(), Calls()
    real_redis.hset(keys.job("quiet"), "status", "queued")  # waits in the queue, not lost
    gen = relay(hub, "quiet", renderer, ping=PING_SECONDS, on_end=ended, on_hang_up=hung_up)
    assert pull(gen) == "start\n\n"
    assert pull(gen) == PING
    assert pull(gen) == PING
    assert hub.open == 1
    add_token(real_redis, "quiet", 0)
    finish(real_redis, "quiet")
    writes = [w for w in _rest(gen, pull) if w != PING]
    assert [m.event for w in writes for m in parse_text(w)] == ["token", "done"]
    assert (ended.count, hung_up.count, renderer.errors) == (1, 0, [])
    assert hub.open == 0


@pytest.mark.integration
def test_a_stream_resumes_after_the_entry_id_its_client_gave(
    real_redis: redis.Redis, pull: Any, make_hub: Any
) -> None:
    first = add_token(real_redis, "resumed", 0)
    second = add_token(real_redis, "resumed", 1)
    finish(real_redis, "resumed")
    renderer = Recorder()
    gen = relay(make_hub(), "resumed", renderer, ping=PING_SECONDS, after=first)
    _rest(gen, pull)
    events = [e for batch in renderer.batches for e in batch]
    assert [e.kind for e in events] == ["token", "done"]
    assert events[0].id == second and events[0].message.index == 1


@pytest.mark.integration
@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (PoolExhausted("every connection stayed in use"), "redis_pool_exhausted"),
        (redis.ConnectionError("Connection refused"), "broker_down"),
    ],
)
def test_a_reader_that_fails_ends_every_stream_with_its_one_error(
    real_redis: redis.Redis, pull: Any, make_hub: Any, exc: Exception, code: str
) -> None:
    placement = SharedReaders(real_redis)

    def failing_xread(streams: dict[str, str], count: int, block: int) -> Any:
        raise exc

    placement.xread = failing_xread
    hub = make_hub(placement)
    renderer, hung_up = Recorder(), Calls()
    gen = relay(hub, "doomed", renderer, ping=PING_SECONDS, on_hang_up=hung_up)
    writes = _rest(gen, pull)
    [message] = [m for w in writes for m in parse_text(w) if m.event == "error"]
    assert message.json()["error"]["code"] == code
    assert hung_up.count == 0  # a failure is no hang-up: the job is not cancelled
    assert hub.open == 0


@pytest.mark.integration
def test_a_job_events_stream_ends_with_event_error_when_the_pool_is_exhausted(
    real_redis: redis.Redis, pull: Any, make_hub: Any
) -> None:
    """The same failure as a job's `/events` shows it (api/jobs.py's renderer)."""
    placement = SharedReaders(real_redis)

    def failing_xread(streams: dict[str, str], count: int, block: int) -> Any:
        raise PoolExhausted("every connection stayed in use")

    placement.xread = failing_xread
    hub = make_hub(placement)
    gen = relay(hub, "busy", JobEventRenderer(1500), ping=PING_SECONDS)
    messages = [m for w in _rest(gen, pull) for m in parse_text(w)]
    assert messages[0].retry == 1500
    assert messages[-1].event == "error"
    assert (
        messages[-1].json()
        == ServiceUnavailable(
            "This API process is busy (all its Redis connections are in use); retry later.",
            code="redis_pool_exhausted",
        ).body()
    )


@pytest.mark.integration
@pytest.mark.parametrize(
    ("fail_with", "code"),
    [(ValueError("a renderer bug"), "internal_error"), (InvalidRequest("refused"), None)],
)
def test_a_renderer_that_fails_ends_the_stream_with_its_error(
    real_redis: redis.Redis, pull: Any, make_hub: Any, fail_with: Exception, code: str | None
) -> None:
    add_token(real_redis, "broken", 0)
    renderer, hung_up = Recorder(fail_with=fail_with), Calls()
    gen = relay(make_hub(), "broken", renderer, ping=PING_SECONDS, on_hang_up=hung_up)
    _rest(gen, pull)
    [error] = renderer.errors
    if isinstance(fail_with, APIError):
        assert error is fail_with
    else:
        assert isinstance(error, InternalError) and error.body()["error"]["code"] == code
    assert hung_up.count == 0


@pytest.mark.integration
def test_a_job_that_will_send_no_end_is_ended_by_the_hub(
    real_redis: redis.Redis, pull: Any, make_hub: Any
) -> None:
    """No record: the hub's check of idle followers (api/streams/lost_jobs.py) hands the
    relay a `job_lost` error event, which the renderer shows as any end."""
    renderer, ended = Recorder(), Calls()
    gen = relay(make_hub(), "vanished", renderer, ping=PING_SECONDS, on_end=ended)
    _rest(gen, pull)
    [end] = [e for batch in renderer.batches for e in batch]
    assert end.kind == "error" and end.message.error["code"] == "job_lost"
    assert ended.count == 1 and renderer.errors == []


# ---------------------------------------------------------------- hang-up


@pytest.mark.integration
def test_a_client_whose_socket_closed_is_let_go_and_its_job_cancelled_once(
    real_redis: redis.Redis, pull: Any, make_hub: Any
) -> None:
    real_redis.hset(keys.job("left"), "status", "queued")
    server_side, client_side = socket.socketpair()
    try:
        watch = DisconnectWatch({"werkzeug.socket": server_side}, interval=0.0)
        hub, hung_up = make_hub(), Calls()
        gen = relay(hub, "left", Recorder(), ping=PING_SECONDS, watch=watch, on_hang_up=hung_up)
        assert pull(gen) == "start\n\n"
        assert pull(gen) == PING  # still there
        client_side.close()
        assert set(_rest(gen, pull)) <= {PING}  # then nothing but pings until it stops
        assert hung_up.count == 1
        assert hub.open == 0
    finally:
        server_side.close()
        client_side.close()


@pytest.mark.integration
def test_a_failed_write_cancels_before_the_end_and_not_after_it(
    real_redis: redis.Redis, pull: Any, make_hub: Any
) -> None:
    real_redis.hset(keys.job("written"), "status", "queued")
    hub, hung_up = make_hub(), Calls()
    gen = relay(hub, "written", Recorder(), ping=PING_SECONDS, on_hang_up=hung_up)
    assert pull(gen) == "start\n\n"
    gen.close()  # what the server does when a write to a gone client fails
    assert hung_up.count == 1
    assert hub.open == 0

    finish(real_redis, "ended")
    ended_hang_up = Calls()
    gen = relay(hub, "ended", Recorder(), ping=PING_SECONDS, on_hang_up=ended_hang_up)
    assert pull(gen) == "start\n\n"
    assert "event: done" in pull(gen)
    gen.close()  # the write of the end failed: the job had ended, nothing to cancel
    assert ended_hang_up.count == 0


def test_the_streams_package_imports_no_surface_that_uses_it() -> None:
    """docs/architecture.md: api/streams/ lies below the blueprints and api/flow.py."""
    graph = import_graph(module_files())
    streams = {m: targets for m, targets in graph.items() if m.startswith("api.streams")}
    assert "api.streams.relay" in streams
    allowed = ("api.streams", "api.config", "api.errors", "workers.", "runtime.")
    breaches = {m: sorted(t for t in ts if not t.startswith(allowed)) for m, ts in streams.items()}
    assert {m: ts for m, ts in breaches.items() if ts} == {}
