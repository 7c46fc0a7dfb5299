"""The readers of one API process for every job stream its clients wait on.

A waiting client (an SSE stream, a `/events` listener, a sync request waiting for its job's
end) costs a `Follower`, a small queue and an event, not a thread and not a Redis
connection: a reader thread (a greenlet under gunicorn's gevent worker) XREADs a group of up
to GROUP_SIZE followed streams in one blocking call, each from the last entry its followers
have, and hands the entries out; a process has up to MAX_READERS of them (`StreamHub`). A
reader exists only while someone follows; its call is re-issued when its group changes: a
follower added while it blocks wakes it through the reader's own wake stream
(`keys.api_wake`, one XADD per blocked call at most), so its first events are not held back
by the block.

The stream stays the only source of truth (docs/faults.md L7): a follower starts from the
id its client gave, and a job whose record vanished, or ended without a terminal event,
gets a synthesized one from the reader's periodic check of idle followers
(api/streams/lost_jobs.py).

Which reader reads which stream, and how its XREAD reaches Redis, is the reader placement's
that api/app.py hands the hub when the app starts: `SharedReaders` on one Redis (any streams
share a call; the reply read raw, api/streams/xread_replies.py), `slot_routing.BucketReaders` on an
events cluster (a reader per event bucket, its XREAD sent to the bucket's node).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from api.streams.lost_jobs import find_lost
from api.streams.xread_replies import XRead, raw_xread
from workers import keys
from workers.wire.events import StreamEvent, decode, is_terminal
from workers.wire.text import as_str

log = logging.getLogger(__name__)

BLOCK_MS = 1000  # below the client's 2 s socket timeout (api.config.REDIS_SOCKET_TIMEOUT)
COUNT = 256  # entries per stream and call; a longer backlog takes several calls
CHECK_SECONDS = 1.0  # how often the reader looks for idle followers
IDLE_SECONDS = 0.5  # a follower with no event for this long has its record checked ...
RECHECK_SECONDS = 2.0  # ... and again this long after (thousands of queued jobs wait)
RETRY_SECONDS = 0.2  # after a failed XREAD (its followers were told), before the next
# A reply later than the socket timeout (a busy process or Redis) is read again from the same
# ids this many times before the followers are told the broker is down: one stall must not
# end every open stream with `broker_down` while Redis is up.
STALLS_TOLERATED = 2
WAKE_TTL_SECONDS = 3600
GROUP_SIZE = 256  # streams per XREAD (one reader) while readers are left ...
MAX_READERS = 16  # ... and readers per process: connections held blocking
# With more than PAUSE_ABOVE streams followed, a call re-issued at once after a join waits
# until JOIN_PAUSE after the previous one began, and after events until EVENT_PAUSE: at
# 2,000 streams a call cost Redis ~1 ms, and one per join took its CPU (bench/streams.py).
PAUSE_ABOVE = 64
JOIN_PAUSE = 0.05
EVENT_PAUSE = 0.002


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


def entry_id(value: str) -> tuple[int, int]:
    """A stream entry id as numbers, for ordering ("0" is the start)."""
    ms, _, seq = value.partition("-")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class Follower:
    """One client's place in one job's stream: events the reader delivered and not yet
    taken, and the event that wakes the client's thread (or greenlet)."""

    job_id: str
    last: str
    reader: StreamReader | None = None
    key: str = ""
    events: deque[Event] = field(default_factory=deque)
    wake: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    active_at: float = field(default_factory=time.monotonic)
    checked_at: float = 0.0  # when the reader last looked at its job record
    ended: bool = False

    def __post_init__(self) -> None:
        self.key = keys.job_events(self.job_id)
        self.position = entry_id(self.last)

    def take(self, timeout: float) -> list[Event]:
        """What arrived since the last call, waiting up to `timeout` for something (or for
        `wake` set by someone else: the caller then finds an empty list). Raises the error
        that stopped the reader for this follower (Redis unreachable)."""
        if not self.events and self.error is None:
            self.wake.wait(timeout)
        self.wake.clear()  # before draining: an event added meanwhile sets it again
        taken = []
        while self.events:
            taken.append(self.events.popleft())
        if not taken and self.error is not None:
            raise self.error
        return taken

    def deliver(self, event: Event) -> None:
        self.events.append(event)
        self.last, self.position = event.id, entry_id(event.id)
        self.active_at = time.monotonic()
        self.ended = self.ended or event.terminal
        self.wake.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.wake.set()


class ReaderPlacement(Protocol):
    """Which reader reads a job's stream, and how readers reach Redis: one object per broker
    mode, chosen when the app starts (`SharedReaders`, `slot_routing.BucketReaders`)."""

    events: Any  # the client the streams are on
    xread: XRead  # a reader's one XREAD over its streams

    def reader_for(self, job_id: str, new: Callable[[str], StreamReader]) -> StreamReader:
        """The reader for `job_id`'s stream; `new(wake_key)` makes one (and the hub keeps
        it)."""
        ...

    def cluster_connections(self) -> int | None:
        """Connections open to an events cluster's nodes (`llmq_api_events_connections_open`);
        None without one."""
        ...


class StreamHub:
    """The readers of one API process (`follow`, `leave`); `app.extensions["streams"]`.

    `conn` holds the job records; `placement` says where the streams are and which reader
    reads each (`SharedReaders` over `conn` by default). Each reader holds one connection
    while it blocks."""

    def __init__(
        self,
        conn: redis.Redis,
        block_ms: int = BLOCK_MS,
        group_size: int = GROUP_SIZE,
        max_readers: int = MAX_READERS,
        placement: ReaderPlacement | None = None,
    ) -> None:
        self.conn = conn  # the job records (the queue Redis)
        self.placement = placement or SharedReaders(conn, group_size, max_readers)
        self.block_ms = block_ms
        self.readers: list[StreamReader] = []
        self._lock = threading.Lock()

    @property
    def open(self) -> int:
        """Followers now (the `llmq_api_streams_open` gauge)."""
        return sum(reader.open for reader in list(self.readers))

    def follow(self, job_id: str, after: str = "0") -> Follower:
        with self._lock:
            reader = self.placement.reader_for(job_id, self._new_reader)
        return reader.follow(job_id, after)

    def leave(self, follower: Follower) -> None:
        if follower.reader is not None:
            follower.reader.leave(follower)

    def _new_reader(self, wake_key: str) -> StreamReader:
        placement = self.placement
        reader = StreamReader(self.conn, self.block_ms, placement.events, placement.xread, wake_key)
        self.readers.append(reader)
        return reader


class SharedReaders:
    """The streams on one Redis (the queue Redis, or a Sentinel's master): any streams may
    share a reader's XREAD, read raw (api/streams/xread_replies.py).

    An XREAD costs Redis and this process in proportion to the streams it names (26 ms for
    5,000 on this 2-core EPYC), and it is re-issued at every join and after every event, so
    the followed streams are split between up to `max_readers` readers of `group_size`
    streams each (more each once all readers are full): a join or an event re-issues one
    group's call."""

    def __init__(
        self, events: redis.Redis, group_size: int = GROUP_SIZE, max_readers: int = MAX_READERS
    ) -> None:
        self.events = events
        self.xread = raw_xread(events)
        self.group_size = group_size
        self.max_readers = max_readers
        self._readers: list[StreamReader] = []

    def reader_for(self, job_id: str, new: Callable[[str], StreamReader]) -> StreamReader:
        key = keys.job_events(job_id)
        for reader in self._readers:
            if reader.reads(key):
                return reader  # one job's followers share its reader's one read
        for reader in self._readers:
            if reader.size < self.group_size:
                return reader
        if len(self._readers) < self.max_readers:
            self._readers.append(new(keys.api_wake(uuid.uuid4().hex)))
            return self._readers[-1]
        return min(self._readers, key=lambda r: r.size)

    def cluster_connections(self) -> None:
        return None  # the readers' connections are the queue Redis's, counted with its pool


class StreamReader:
    """One blocking XREAD over a group of followed streams, in its own thread (greenlet)."""

    def __init__(
        self,
        conn: redis.Redis,
        block_ms: int = BLOCK_MS,
        events: Any = None,
        xread: XRead | None = None,
        wake_key: str | None = None,
    ) -> None:
        """`conn` holds the job records, `events` (`conn` by default) the streams, read by
        `xread` (`conn`'s raw XREAD by default); `wake_key` names the reader's own wake
        stream, which its XREAD reads with the followed ones (the same slot on a cluster)."""
        self.conn = conn
        self.events = conn if events is None else events
        self._xread = xread or raw_xread(self.events)
        self.block_ms = block_ms
        self.wake_key = wake_key or keys.api_wake(uuid.uuid4().hex)
        self._wake_last = "0"
        self._by_key: dict[str, set[Follower]] = {}
        # where the next XREAD reads each followed stream from: at or before the id of every
        # follower of it; kept as followers join and events are handed out, not recomputed
        # over every stream before each call (at 1,000 streams that took 4.5% of the API)
        self._after: dict[str, str] = {}
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._pid = os.getpid()
        self._reading = False  # a snapshot was taken and its XREAD may be blocking
        self._woken = False  # a wake was sent for the current call
        self._checked = time.monotonic()

    @property
    def open(self) -> int:
        """Followers now."""
        with self._lock:
            return sum(len(f) for f in self._by_key.values())

    @property
    def size(self) -> int:
        """Streams this reader reads."""
        return len(self._by_key)

    def reads(self, key: str) -> bool:
        return key in self._by_key

    def follow(self, job_id: str, after: str = "0") -> Follower:
        follower = Follower(job_id, after, reader=self)
        with self._lock:
            self._by_key.setdefault(follower.key, set()).add(follower)
            current = self._after.get(follower.key)
            if current is None or follower.position < entry_id(current):
                self._after[follower.key] = after
            self._start_reader()
            wake = self._reading and not self._woken
            self._woken = self._woken or wake
        if wake:
            self._wake()
        return follower

    def leave(self, follower: Follower) -> None:
        with self._lock:
            self._drop(follower)

    def _drop(self, follower: Follower) -> None:
        followers = self._by_key.get(follower.key)
        if followers is not None:
            followers.discard(follower)
            if not followers:
                del self._by_key[follower.key]
                self._after.pop(follower.key, None)

    def _start_reader(self) -> None:
        if self._pid != os.getpid():  # forked after it started: the thread stayed behind
            self._pid, self._reader = os.getpid(), None
        if self._reader is None:
            self._reader = threading.Thread(target=self._run, name="llmq-streams", daemon=True)
            self._reader.start()

    def _wake(self) -> None:
        try:
            with self.events.pipeline(transaction=False) as pipe:
                pipe.xadd(self.wake_key, {"w": "1"}, maxlen=1, approximate=False)
                pipe.expire(self.wake_key, WAKE_TTL_SECONDS)
                pipe.execute()
        except redis.RedisError as exc:  # the reader comes round within its block anyway
            log.debug("stream reader not woken: %s", exc)

    def _run(self) -> None:
        stalls = 0
        while True:
            with self._lock:
                if not self._by_key:
                    self._reader, self._reading = None, False
                    return
                streams = dict(self._after)
                self._reading, self._woken = True, False
            streams[self.wake_key] = self._wake_last
            try:
                issued = time.monotonic()
                reply = self._xread(streams, COUNT, self._block())
                stalls = 0
                woken = self._deliver(reply or [], streams)
                # Each call costs Redis and this process O(streams followed): a burst of
                # joins (or of events) is gathered for a moment instead of one call each
                pause = (JOIN_PAUSE if woken else EVENT_PAUSE) - (time.monotonic() - issued)
                if reply and pause > 0 and len(streams) > PAUSE_ABOVE:
                    time.sleep(pause)
                if time.monotonic() - self._checked >= CHECK_SECONDS:
                    self._check_idle()
            except redis.TimeoutError as exc:  # slow, not gone: the positions are kept
                stalls += 1
                log.warning("stream reader: Redis answered late (%d in a row)", stalls)
                if stalls > STALLS_TOLERATED:
                    self._fail_all(exc)
                    time.sleep(RETRY_SECONDS)
                continue
            except redis.RedisError as exc:
                self._fail_all(exc)
                time.sleep(RETRY_SECONDS)
            except Exception:  # never leave followers waiting on a dead reader
                log.exception("stream reader failed")
                self._fail_all(redis.RedisError("the stream reader failed"))
                time.sleep(RETRY_SECONDS)
            finally:
                self._reading = False

    def _block(self) -> int:
        left = CHECK_SECONDS - (time.monotonic() - self._checked)
        return max(1, min(self.block_ms, int(left * 1000)))

    def _deliver(self, reply: Any, read_after: dict[str, str]) -> bool:
        """Hand out what one XREAD (from the ids in `read_after`) returned; whether it held a
        wake (a join). A follower that joined during the call from an earlier id (a client
        reconnecting with Last-Event-ID) gets nothing of it: the events between its id and
        the call's are not in this reply, and the next call starts from its id."""
        woken = False
        for raw_key, entries in reply.items() if isinstance(reply, dict) else reply:
            key = as_str(raw_key)
            if key == self.wake_key:
                self._wake_last = as_str(entries[-1][0]) if entries else self._wake_last
                woken = True
                continue
            covered = entry_id(read_after[key])
            with self._lock:
                followers = list(self._by_key.get(key, ()))
            readers = [f for f in followers if f.position >= covered]
            for raw_id, fields in entries:
                event = Event(as_str(raw_id), decode(fields))
                position = entry_id(event.id)
                for follower in readers:
                    if position > follower.position and not follower.ended:
                        follower.deliver(event)
            with self._lock:
                for follower in followers:
                    if follower.ended:
                        self._drop(follower)  # nothing follows a terminal event
                left = self._by_key.get(key)
                if left:  # joins during the call included: they lowered it
                    self._after[key] = _earliest(left)
        return woken

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            followers = [f for fs in self._by_key.values() for f in fs]
            self._by_key.clear()
            self._after.clear()
        for follower in followers:
            follower.fail(error)

    def _check_idle(self) -> None:
        """A terminal event for each idle follower whose job will send none
        (`lost_jobs.find_lost`); its follower then leaves."""
        self._checked = now = time.monotonic()
        with self._lock:
            idle = [
                f
                for fs in self._by_key.values()
                for f in fs
                if now - f.active_at >= IDLE_SECONDS and now - f.checked_at >= RECHECK_SECONDS
            ]
        for follower in idle:
            follower.checked_at = now
        waited = [(follower, now - follower.active_at) for follower in idle]
        for follower, message in find_lost(self.conn, self.events, waited):
            follower.deliver(Event(follower.last, message))
            self.leave(follower)


def _earliest(followers: set[Follower]) -> str:
    return min(followers, key=lambda f: f.position).last
