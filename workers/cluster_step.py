"""A step's writes when the token events live on a Redis Cluster (`LLMQ_EVENTS_CLUSTER`).

On one Redis a step is one script call (`scripts.write_step`): lease, stream, record,
running set and metrics are read and written together. With an events cluster the stream
and its lease are on the cluster (one hash slot per job: `keys.job_events`, `keys.job_lease`)
and the rest on the queue Redis, and no script spans two servers. So a step is two round
trips, in this order, both in the writer thread beside the next decode step:

1. the cluster: each writing job's events, fenced by its lease and the stream's length
   (`_APPEND_EVENTS`, by EVALSHA: one call per event bucket with jobs in the step, every
   node's calls in one write). A final write gives the lease up there.
2. the queue Redis: the record fields of the jobs whose events landed, their ends (leave
   the running set, count the end, settle the rate-limit reservation: once, only by the call
   that takes the job out of the running set) and every job's cancel flag
   (`_RECORD_STEP`), with the step's metrics, in one round trip (`workers.resp`).

A job's end is in its stream (the terminal event, fenced) before its record says so. A
worker that dies between the two leaves a running job with no lease whose stream ends in a
terminal event: the reaper finishes its record from that event (`finish_from_stream`)
instead of running it again (docs/faults.md, "Token events on a Redis Cluster"). A step
sent again after a failed round trip is applied once: the events' retry check finds them
landed, and the record's end counts only when it leaves the running set.

The reply has `scripts.write_step`'s shape (2 characters a job), so `EventWriter` reads
both the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import (
    AskError,
    ClusterDownError,
    ConnectionError,
    NoScriptError,
    ResponseError,
    TryAgainError,
)

from workers import keys, resp, scripts
from workers.wire.defaults import JOB_TTL_SECONDS
from workers.wire.events import (
    EVENT_DONE,
    EVENT_ERROR,
    StreamDone,
    StreamError,
    decode_event,
    ending,
    write_ending,
)
from workers.wire.job import CANCELLED, FAILED, FINISHED
from workers.wire.loaded_script import LoadedScript

# One event bucket's writes of a step (every key in the bucket's slot: `keys.job_events`).
# KEYS: per job, lease and events stream. ARGV: ttl (s), then per job: expected lease, write
# mode (scripts.STEP_*), stream length the writer expects before its events, m, then m event
# kind/data pairs. Returns one character a job: "1" if written (or already written by this
# same call, retried after a lost reply), "0" if the lease or the stream is not as the
# writer left it (nothing written for it).
_APPEND_EVENTS = """
local call = redis.call
local ttl = ARGV[1]
local out = {}
local a = 2
for j = 1, #KEYS / 2 do
  local lease_key, events_key = KEYS[2 * j - 1], KEYS[2 * j]
  local lease, mode = ARGV[a], ARGV[a + 1]
  local expected, m = tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local e = a + 4
  local last_data = ARGV[e + 2 * m - 1]
  a = e + 2 * m
  local length = call('XLEN', events_key)
  local done = '0'
  if m > 0 and length == expected + m then
    local last = call('XREVRANGE', events_key, '+', '-', 'COUNT', 1)[1]
    if last[2][4] == last_data then done = '1' end
  end
  if done == '0' and length == expected and call('GET', lease_key) == lease then
    for i = e, e + 2 * m - 1, 2 do
      call('XADD', events_key, '*', 'event', ARGV[i], 'data', ARGV[i + 1])
    end
    if mode ~= '1' and (m > 0 or length > 0) then call('EXPIRE', events_key, ttl) end
    if mode == '3' then call('DEL', lease_key) end
    done = '1'
  end
  out[j] = done
end
return table.concat(out)
"""

# KEYS: running set, jobs metric hash, webhook outbox, then c cancel flags (every job of the
# step), then a
# record per job that has something for it. ARGV: ttl (s), c, then per such job: job id,
# write mode (scripts.STEP_*), tokens used ('' if not known), n record fields, then 2n
# field/value strings. Returns c characters: "1" where that cancel flag is set. A final
# write's end is counted and settled only by the call that takes the job out of the running
# set, so a retried or recovered end counts once (and appends the outbox entry of a job marked
# as notifying, `wire.webhooks`, once). A step of running jobs with nothing new
# for their records (most steps: counters go every second) is one MGET here.
_RECORD_STEP = (
    scripts.END_JOB_LUA
    + """
local call = redis.call
local running, jobs_metric, outbox = KEYS[1], KEYS[2], KEYS[3]
local ttl, c = ARGV[1], tonumber(ARGV[2])
local out = {}
if c > 0 then
  for j, flag in ipairs(call('MGET', unpack(KEYS, 4, 3 + c))) do
    out[j] = flag and '1' or '0'
  end
end
local a = 3
for k = 4 + c, #KEYS do
  local record_key = KEYS[k]
  local job_id, mode, used, n = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2]), tonumber(ARGV[a + 3])
  local f = a + 4
  if n > 0 then call('HSET', record_key, unpack(ARGV, f, f + 2 * n - 1)) end
  if mode ~= '1' then call('EXPIRE', record_key, ttl) end
  if mode == '3' and call('SREM', running, job_id) == 1 then
    llmq_end(record_key, jobs_metric, outbox, job_id, used)
  end
  a = f + 2 * n
end
return table.concat(out)
"""
)

# error replies of a cluster whose slots are moving or whose primary is being replaced
MOVING = (AskError, TryAgainError, ClusterDownError)  # MovedError is an AskError

APPEND_EVENTS = LoadedScript(_APPEND_EVENTS)
RECORD_STEP = LoadedScript(_RECORD_STEP)

Entry = tuple[list[str], list[Any]]  # `scripts.step_entry`: keys and arguments of one job


def write_step(
    events: Any,
    queue: Any,
    entries: Sequence[Entry],
    metrics: Sequence[Sequence[Any]] = (),
    ttl: int = JOB_TTL_SECONDS,
) -> str:
    """Every job's writes of one step (`scripts.step_entry` each) over the events cluster
    and the queue Redis, with `metrics` (commands) on the queue Redis: `scripts.write_step`'s
    reply string, "{written}{cancel}" a job."""
    landed = append_events(events, entries, ttl)
    cancels = record_step(queue, entries, landed, metrics, ttl)
    return "".join(f"{int(w)}{c}" for w, c in zip(landed, cancels, strict=True))


def append_events(events: Any, entries: Sequence[Entry], ttl: int = JOB_TTL_SECONDS) -> list[bool]:
    """Round trip 1: each writing job's fenced events on the cluster; per job, True if
    written (or nothing to write)."""
    landed = [True] * len(entries)
    buckets: dict[int, tuple[list[int], list[str], list[Any]]] = {}
    for j, (job_keys, args) in enumerate(entries):
        lease, mode, expected, n, m = args[0], args[2], args[3], int(args[6]), int(args[7])
        if mode == scripts.STEP_CHECK_ONLY:
            continue
        start = 8 + 2 * n
        jobs, call_keys, call_args = buckets.setdefault(keys.event_bucket(args[1]), ([], [], [ttl]))
        jobs.append(j)
        call_keys += job_keys[:2]
        call_args += [lease, mode, expected, m, *args[start : start + 2 * m]]
    if not buckets:
        return landed
    calls = [(call_keys, call_args) for _, call_keys, call_args in buckets.values()]
    replies = per_node(events, APPEND_EVENTS, calls)
    for (jobs, _, _), reply in zip(buckets.values(), replies, strict=True):
        flags = reply.decode() if isinstance(reply, bytes) else reply
        for j, flag in zip(jobs, flags, strict=True):
            landed[j] = flag == "1"
    return landed


def per_node(
    events: Any, script: LoadedScript, calls: Sequence[tuple[list[str], list[Any]]]
) -> list[Any]:
    """`script` called once per (keys, args) in `calls` (keys of one slot each), each on
    the node that holds its slot: one write and one read per node (redis-py's cluster
    pipeline refuses EVALSHA). A node that lost its scripts gets them loaded and the calls
    it answered NOSCRIPT to sent again; any other error reply is raised."""
    replies = _pipelined(events, script, calls)
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:  # a node lost its script cache (restart, failover): load it, call again
        script.load(events)
        again = _pipelined(events, script, [calls[i] for i in missing])
        for i, reply in zip(missing, again, strict=True):
            replies[i] = reply
    for reply in replies:
        if isinstance(reply, MOVING):
            # the slot moved or the cluster is electing: away for now, as a lost
            # connection is (every room backs off and sends the same step again)
            raise ConnectionError(f"events cluster: {reply}") from reply
        if isinstance(reply, Exception):
            raise reply
    return replies


def _pipelined(
    events: Any, script: LoadedScript, calls: Sequence[tuple[list[str], list[Any]]]
) -> list[Any]:
    """Each call on the node that holds its slot: every node's calls packed into one write
    (`workers.resp`), all nodes written before any is read. An error reply (NOSCRIPT,
    MOVED after a resharding or failover) comes back in its place; MOVED also makes the
    client learn the cluster's slots again before the step is sent again."""
    by_node: dict[str, tuple[Any, list[int]]] = {}
    for i, (job_keys, _) in enumerate(calls):
        node = events.get_node_from_key(job_keys[0])
        by_node.setdefault(node.name, (node, []))[1].append(i)
    replies: list[Any] = [None] * len(calls)
    sent = []
    try:
        for node, indexes in by_node.values():
            pool = events.get_redis_connection(node).connection_pool
            connection = pool.get_connection()
            sent.append((pool, connection, indexes))
            packed = [
                resp.pack(["EVALSHA", script.sha, len(calls[i][0]), *calls[i][0], *calls[i][1]])
                for i in indexes
            ]
            connection.send_packed_command([b"".join(packed)])
        for _, connection, indexes in sent:
            for i in indexes:
                try:
                    replies[i] = connection.read_response()
                except ResponseError as exc:
                    replies[i] = exc
    except BaseException:
        for _, connection, _ in sent:
            connection.disconnect()  # replies may be left unread on it
        raise
    finally:
        for pool, connection, _ in sent:
            pool.release(connection)
    if any(isinstance(r, MOVING) for r in replies):
        events.nodes_manager.initialize()
    return replies


def record_step(
    queue: Any,
    entries: Sequence[Entry],
    landed: Sequence[bool],
    metrics: Sequence[Sequence[Any]] = (),
    ttl: int = JOB_TTL_SECONDS,
) -> list[str]:
    """Round trip 2: the records of the jobs whose events `landed`, their ends, every
    job's cancel flag, and the step's `metrics`; one "1"/"0" cancel flag a job."""
    cancel_keys = [job_keys[3] for job_keys, _ in entries]
    record_keys: list[str] = []
    step_args: list[Any] = [ttl, len(cancel_keys)]
    for (job_keys, args), written in zip(entries, landed, strict=True):
        mode, n = args[2], int(args[6])
        if not written or mode == scripts.STEP_CHECK_ONLY or (mode == scripts.STEP_WRITE and not n):
            continue  # nothing for its record
        record_keys.append(job_keys[2])
        step_args += [args[1], mode, args[4], n, *args[8 : 8 + 2 * n]]
    step_keys = [keys.RUNNING, keys.METRIC_JOBS, keys.WEBHOOK_OUTBOX, *cancel_keys, *record_keys]
    reply = resp.script_round_trip(queue, RECORD_STEP, step_keys, step_args, metrics)
    flags = reply.decode() if isinstance(reply, bytes) else reply
    checks = [args[5] == "1" for _, args in entries]
    return [flag if check else "0" for flag, check in zip(flags, checks, strict=True)]


def finish_from_stream(events: Any, queue: Any, job_id: str) -> str | None:
    """A running job whose worker died after its final events landed on the cluster and
    before its record heard of them: end the record from the stream's terminal event (the
    same fields the worker would have written; the end counted once). The status it ended
    with, or None when the stream does not end in a terminal event (then it resumes)."""
    last = events.xrevrange(keys.job_events(job_id), count=1)
    if not last:
        return None
    kind, data = decode_event(last[0][1])  # only the kind matters: no token is read
    if kind == EVENT_DONE:
        status, body = FINISHED, StreamDone.from_data(data).to_data()
    elif kind == EVENT_ERROR:
        error = StreamError.from_data(data)
        code = (error.error or {}).get("code")
        status, body = (CANCELLED if code == "cancelled" else FAILED), error.to_data()
    else:
        return None
    fields, _ = ending(status, body)
    usage = body.get("usage") if status == FINISHED else None
    used = None
    if usage:
        used = usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0)
        fields["completion_tokens"] = str(usage.get("completion_tokens", 0))
        fields["prompt_tokens"] = str(usage.get("prompt_tokens", 0))
    entry = scripts.step_entry(job_id, "", scripts.STEP_FINAL, 0, (), fields, used, False)
    record_step(queue, [entry], [True])
    return status


def end_unclaimed(events: Any, queue: Any, job_id: str, status: str, body: dict[str, Any]) -> None:
    """The end of a job nobody holds a lease on (cancelled while queued): its terminal
    event on the cluster, then its record and count (`wire.events.write_ending`)."""
    with queue.pipeline() as pipe:
        write_ending(pipe, job_id, status, body, events)
        pipe.execute()
