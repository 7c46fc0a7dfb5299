"""api/streams/stream_hub.py against a real Redis: one reader hands each follower exactly the events
after its own id, wakes for a follower added while it blocks, and repairs a job that ended
without a terminal event only when nothing more is in its stream (docs/faults.md F8)."""

from __future__ import annotations

import time

import pytest
import redis

from api.streams.lost_jobs import LOST_GRACE_SECONDS
from api.streams.stream_hub import (
    RECHECK_SECONDS,
    STALLS_TOLERATED,
    Follower,
    StreamHub,
    StreamReader,
)
from tests.api.job_streams import add_token as _token
from tests.api.job_streams import finish as _finish
from workers import keys
from workers.wire.job import FINISHED

pytestmark = pytest.mark.integration


def _drain(follower, until_terminal: bool = True, timeout: float = 10.0) -> list:
    """Everything the follower gets until its terminal event (or `timeout` of nothing)."""
    got = []
    while True:
        events = follower.take(timeout)
        if not events:
            return got
        got.extend(events)
        if until_terminal and got[-1].terminal:
            return got


def test_followers_of_many_jobs_get_their_own_events_each_after_its_own_id(
    real_redis: redis.Redis,
) -> None:
    hub = StreamHub(real_redis)
    first = {job: _token(real_redis, job, 0) for job in ("a", "b", "c")}
    for job in ("a", "b", "c"):
        _token(real_redis, job, 1)
    from_start = {job: hub.follow(job) for job in ("a", "b", "c")}
    resumed = hub.follow("a", first["a"])  # a reconnect with Last-Event-ID
    for job in ("a", "b", "c"):
        _finish(real_redis, job)
    for job, follower in from_start.items():
        kinds = [(e.kind, getattr(e.message, "index", None)) for e in _drain(follower)]
        assert kinds == [("token", 0), ("token", 1), ("done", None)], job
    assert [e.kind for e in _drain(resumed)] == ["token", "done"]
    for follower in [*from_start.values(), resumed]:
        hub.leave(follower)
    assert hub.open == 0


def test_a_follower_added_while_the_reader_blocks_wakes_it(real_redis: redis.Redis) -> None:
    hub = StreamReader(real_redis, block_ms=900)
    waiting = hub.follow("quiet")
    real_redis.xadd(keys.job_events("noise"), {"event": "x", "data": "{}"})  # nobody follows
    for _ in range(100):  # until the reader is inside its blocking XREAD
        if hub._reading:
            break
        waiting.take(0.01)
    newcomer = hub.follow("late")
    assert real_redis.xlen(hub.wake_key) == 1  # the reader's own wake stream got an entry
    assert real_redis.ttl(hub.wake_key) > 0
    _token(real_redis, "late", 0)
    _finish(real_redis, "late")
    assert [e.kind for e in _drain(newcomer)] == ["token", "done"]
    hub.leave(waiting)


def test_a_follower_joining_behind_a_read_in_flight_gets_every_event_once_in_order(
    real_redis: redis.Redis,
) -> None:
    """A client reconnects with Last-Event-ID while the reader's XREAD for the same job, from
    a later id (another client's), is in flight: the reply must not move the newcomer past
    the events between the two ids."""
    ids = [_token(real_redis, "joined", i) for i in range(3)]
    hub = StreamReader(real_redis, block_ms=200)
    behind: list[Follower] = []
    real_xread = hub._xread

    def xread(streams: dict[str, str], count: int, block: int):
        if not behind:
            behind.append(hub.follow("joined", ids[0]))
        return real_xread(streams, count, block)

    hub._xread = xread
    ahead = hub.follow("joined", ids[1])
    for _ in range(200):
        if behind:
            break
        time.sleep(0.01)
    _finish(real_redis, "joined")
    indexes = [getattr(e.message, "index", None) for e in _drain(behind[0])]
    assert indexes == [1, 2, None]
    assert [getattr(e.message, "index", None) for e in _drain(ahead)] == [2, None]


def test_an_ended_job_whose_events_are_still_unread_is_not_repaired(
    real_redis: redis.Redis,
) -> None:
    """The reader's idle check found the record finished, but the job's tokens and its done
    event reached the stream after the last XREAD: they are handed out, not replaced by a
    synthesized done (which would drop the tokens)."""
    hub = StreamReader(real_redis)
    follower = Follower("ended", "0")  # not through follow(): no reader runs, the test
    with hub._lock:  # drives the check itself
        hub._by_key[follower.key] = {follower}
    follower.active_at -= LOST_GRACE_SECONDS + 1
    _token(real_redis, "ended", 0)
    _finish(real_redis, "ended")
    hub._check_idle()
    assert follower.events == type(follower.events)()  # nothing synthesized
    assert hub.open == 1


def test_an_ended_job_without_a_terminal_event_is_repaired_after_the_grace(
    real_redis: redis.Redis,
) -> None:
    hub = StreamReader(real_redis)
    follower = Follower("orphan", "0")  # not through follow(): no reader runs, the test
    with hub._lock:  # drives the check itself
        hub._by_key[follower.key] = {follower}
    real_redis.hset(keys.job("orphan"), mapping={"status": FINISHED, "result": '{"id": "x"}'})
    follower.active_at -= 1.0  # idle, but within the grace: it waits
    hub._check_idle()
    assert not follower.events
    follower.active_at -= LOST_GRACE_SECONDS
    follower.checked_at -= RECHECK_SECONDS  # as if the reader's next look were due
    hub._check_idle()
    assert [e.kind for e in follower.events] == ["done"]
    assert hub.open == 0


def test_a_job_whose_record_is_gone_ends_its_followers_with_job_lost(
    real_redis: redis.Redis,
) -> None:
    hub = StreamHub(real_redis)
    follower = hub.follow("vanished")
    events = _drain(follower)
    assert [e.kind for e in events] == ["error"]
    assert events[0].message.error["code"] == "job_lost"


def test_a_broken_connection_reaches_every_follower(redis_url: str) -> None:
    conn = redis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    hub = StreamHub(conn)
    followers = [hub.follow(f"j{i}") for i in range(3)]
    for follower in followers:
        with pytest.raises(redis.ConnectionError):
            _drain(follower)
    assert hub.open == 0


class _Stalling(redis.Redis):
    """A client whose first `stalls` XREADs time out (a reply later than the socket
    timeout), then reads the real Redis."""

    def __init__(self, conn: redis.Redis, stalls: int) -> None:
        super().__init__(connection_pool=conn.connection_pool)
        self.stalls = stalls

    def execute_command(self, *args, **options):
        if args[0] == "XREAD" and self.stalls:
            self.stalls -= 1
            raise redis.TimeoutError("Timeout reading from socket")
        return super().execute_command(*args, **options)


def test_a_stalled_read_is_read_again_not_reported_as_broker_down(
    real_redis: redis.Redis,
) -> None:
    _token(real_redis, "slow", 0)
    _finish(real_redis, "slow")
    hub = StreamHub(_Stalling(real_redis, STALLS_TOLERATED))
    assert [e.kind for e in _drain(hub.follow("slow"))] == ["token", "done"]


def test_a_read_that_keeps_stalling_ends_the_streams(real_redis: redis.Redis) -> None:
    hub = StreamHub(_Stalling(real_redis, STALLS_TOLERATED + 1))
    with pytest.raises(redis.TimeoutError):
        _drain(hub.follow("stuck"))


def test_streams_are_split_between_readers_of_a_group_each(real_redis: redis.Redis) -> None:
    """Each XREAD names at most `group_size` streams while readers are left (a join or an
    event re-issues one group's call); past `max_readers` the smallest group grows. Every
    follower still gets its events, and followers of one job share one reader."""
    hub = StreamHub(real_redis, group_size=2, max_readers=3)
    jobs = [f"g{i}" for i in range(7)]
    followers = [hub.follow(job) for job in jobs]
    twin = hub.follow("g0", "0")
    assert len(hub.readers) == 3
    assert sorted(r.size for r in hub.readers) == [2, 2, 3]
    assert twin.reader is followers[0].reader
    for job in jobs:
        _token(real_redis, job, 0)
        _finish(real_redis, job)
    for follower in [*followers, twin]:
        assert [e.kind for e in _drain(follower)] == ["token", "done"]
        hub.leave(follower)
    assert hub.open == 0
