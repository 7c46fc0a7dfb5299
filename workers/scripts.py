"""The Lua scripts that make a worker's claims and writes atomic, and their Python wrappers.

Why scripts: taking a job off a queue must mark it running in the same instant (else a
worker that dies between the two loses the job), and every write a worker makes for a job
must be fenced by its lease (docs/faults.md, F12: a worker that stalled past its lease, whose
job another worker now runs, must not write a single token more). A step's writes for
every job are one script call (`write_step`), so they cost one round trip and one command.

The scripts of the token path (`write_step`, one call per decode step for every job, and
`append`) go by hash (EVALSHA, `LoadedScript`): their text is ~3 KB, which EVAL
would send and Redis hash again on every call (bench/redis_cost.py). A Redis that lost its
script cache (restart, failover to a replica) answers NOSCRIPT, and the script is loaded
again and the call repeated: NOSCRIPT means nothing ran. Not a Redis 7 function (FUNCTION
LOAD + FCALL): the same step cost Redis the same there (5.3-5.8 us a token written either way,
64 jobs, bench/redis_cost.py's shape), and a script goes by its content's hash, so workers of
two versions during a rolling upgrade each call their own, where one function library name
would be replaced under the other; EVALSHA also runs on Redis 6 and fakeredis. Scripts
called a few times a second (claim, renew, requeue, release) are sent with EVAL. Job keys
built inside a script use the parts that `workers.keys` names (JOB_KEY_PREFIX, LEASE_SUFFIX,
CANCEL_SUFFIX).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rq.queue import Queue

from workers import keys
from workers.wire import rate_limit, webhooks
from workers.wire.defaults import JOB_TTL_SECONDS
from workers.wire.loaded_script import LoadedScript

RQ_QUEUE_PREFIX = Queue.redis_queue_namespace_prefix  # an RQ queue's key is this + its name
RQ_QUEUES_KEY = Queue.redis_queues_keys  # RQ's set of queue keys (`rq info` lists it)

CLAIMED_MISSING = -1  # the job's record is gone
CLAIMED_CANCELLED = -2  # its cancel flag was set while it was queued: it must never run

# KEYS: n queue keys in service order, then the n keys of their level sets
# (`keys.queue_levels`). ARGV: running set, job key prefix, the event buckets' tags joined
# by ',' (`keys.BUCKET_TAGS`), lease suffix,
# cancel suffix, worker name, lease TTL (ms; 0: no lease here, the caller takes it on the
# events cluster, `workers.claims`), level separator, then each queue's kind rank (0
# interactive, 1 batch). Takes the job that comes first by (kind rank, priority, queue
# order): a queue's jobs of priority p wait on the queue itself for p = 0, else on its
# key .. separator .. p, and its level set scores the levels that may hold jobs (an emptied
# one is dropped here).
# Returns {queue index, job id, attempt} where attempt is the new attempt number (>= 1) or
# one of the CLAIMED_* codes; nil if all empty.
_CLAIM = """
local running, prefix, tags, lease_suffix, cancel_suffix, worker, lease_ms, separator =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local n = #KEYS / 2
local best, best_index, best_rank, best_level
for i = 1, n do
  local queue, levels, rank = KEYS[i], KEYS[n + i], tonumber(ARGV[8 + i])
  local found, level
  local base_waits = redis.call('LLEN', queue) > 0
  for _, p in ipairs(redis.call('ZRANGE', levels, 0, -1)) do
    local value = tonumber(p)
    if value > 0 and base_waits then break end
    if redis.call('LLEN', queue .. separator .. p) > 0 then
      found, level = queue .. separator .. p, value
      break
    end
    redis.call('ZREM', levels, p)
  end
  if found == nil and base_waits then found, level = queue, 0 end
  if found and (best == nil or rank < best_rank or (rank == best_rank and level < best_level)) then
    best, best_index, best_rank, best_level = found, i, rank, level
  end
end
if best == nil then return false end
local id = redis.call('LPOP', best)
local record = prefix .. id
if redis.call('EXISTS', record) == 0 then return {best_index, id, -1} end
if redis.call('EXISTS', record .. cancel_suffix) == 1 then return {best_index, id, -2} end
local attempt = redis.call('HINCRBY', record, 'attempts', 1)
redis.call('SADD', running, id)
if lease_ms ~= '0' then
  local buckets = {}
  for tag in string.gmatch(tags, '[^,]+') do buckets[#buckets + 1] = tag end
  local h = 0  -- keys.event_bucket
  for i = 1, #id do h = (h * 31 + string.byte(id, i)) % 65536 end
  local b = math.floor((h * 40503) % 65536 * #buckets / 65536)
  local lease_key = prefix .. '{' .. buckets[b + 1] .. '}:' .. id .. lease_suffix
  redis.call('SET', lease_key, worker .. ':' .. attempt, 'PX', lease_ms)
end
return {best_index, id, attempt}
"""

# Lua, prepended to every script that writes a job's end (`_APPEND`, `_WRITE_STEP` here,
# `cluster_step._RECORD_STEP`): `llmq_end(record, jobs_metric, outbox, job_id, used)`, called
# once the job has left the running set, counts the job under its final status, settles its
# rate-limit reservation at the tokens it used (`wire.rate_limit`; nothing when it reserved
# none, or `used` is nil) and appends the outbox entry of a job marked as notifying
# (`wire.webhooks`). One text, so the three ways a job ends count it alike.
END_JOB_LUA = (
    rate_limit.SETTLE_LUA
    + webhooks.NOTIFY_LUA
    + """
local function llmq_end(record_key, jobs_metric, outbox, job_id, used)
  local status = redis.call('HGET', record_key, 'status')
  if status then redis.call('HINCRBY', jobs_metric, status, 1) end
  if used then llmq_settle(record_key, used) end
  llmq_notify(record_key, outbox, job_id, status)
end
"""
)

# KEYS: lease, events stream, record, running set, jobs metric hash, webhook outbox.
# ARGV: expected lease, job id, ttl (s), "1" if this ends the job, stream length the writer
# expects before its events, n record fields, tokens the job used ('' if not known), 2n
# field/value strings, event kind/data pairs.
# Returns nil if the lease is not the expected one or the stream is not as the writer left
# it (nothing written), else the id of the last event ("" if none). A write retried after
# its reply was lost finds its own last event already there and is not applied twice.
# The write that ends a job also counts it under its final status, so each job's end is
# counted exactly once, even when its worker dies right after, and settles its rate-limit
# reservation at the tokens it used (`wire.rate_limit`; nothing when it reserved none), and
# appends the outbox entry of a job marked as notifying (`wire.webhooks`).
_APPEND = (
    END_JOB_LUA
    + """
local lease_key, events_key, record_key, running, jobs_metric, outbox = unpack(KEYS)
local lease, job_id, ttl, final, expected, n = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local used = tonumber(ARGV[7])
n, expected = tonumber(n), tonumber(expected)
local first_event = 8 + 2 * n
local n_events = (#ARGV - first_event + 1) / 2
local length = redis.call('XLEN', events_key)
if n_events > 0 and length == expected + n_events then
  local last = redis.call('XREVRANGE', events_key, '+', '-', 'COUNT', 1)[1]
  if last[2][4] == ARGV[#ARGV] then return last[1] end
end
if redis.call('GET', lease_key) ~= lease or length ~= expected then return false end
if n > 0 then
  local fields = {}
  for j = 8, first_event - 1 do fields[#fields + 1] = ARGV[j] end
  redis.call('HSET', record_key, unpack(fields))
  redis.call('EXPIRE', record_key, ttl)
end
local last = ''
for i = first_event, #ARGV - 1, 2 do
  last = redis.call('XADD', events_key, '*', 'event', ARGV[i], 'data', ARGV[i + 1])
end
if last ~= '' then redis.call('EXPIRE', events_key, ttl) end
if final == '1' then
  redis.call('DEL', lease_key)
  redis.call('SREM', running, job_id)
  llmq_end(record_key, jobs_metric, outbox, job_id, used)
end
return last
"""
)

# One decode step's writes for every job a worker runs, in one call (`write_step`).
# KEYS: running set, jobs metric hash, webhook outbox, then per job: lease, events stream,
# record, cancel flag.
# ARGV: ttl (s), then per job 8 values: expected lease, job id, write mode (STEP_* below),
# stream length the writer expects before its events, tokens used ('' if not known), "1" to
# read the cancel flag, n record fields, m events; then 2n field/value strings and 2m event
# kind/data strings. Per job, as `_APPEND`: nothing is written unless the lease is the
# expected one and the stream is as the writer left it, a write retried after its reply was
# lost is not applied twice, and a final write gives up the lease, leaves the running set,
# counts the job's end once, settles its rate-limit reservation and appends the outbox
# entry of a job marked as notifying (`wire.webhooks`: one HMGET, at the final write). TTLs
# are set by a job's first write of an attempt and by its final one, not by every step (the
# record and stream outlive a running job by far). Returns a string of 2 characters per job,
# in order: "1" written (or nothing to write), "0" lease or stream not as expected (nothing
# written); then "1" if its cancel flag is set, else "0" (one string: cheaper to build and to
# read than 2 integers a job).
_WRITE_STEP = (
    END_JOB_LUA
    + """
local call = redis.call
local running, jobs_metric, outbox = KEYS[1], KEYS[2], KEYS[3]
local ttl = ARGV[1]
local lease_keys, cancel_keys = {}, {}
for k = 4, #KEYS, 4 do
  lease_keys[#lease_keys + 1] = KEYS[k]
  cancel_keys[#cancel_keys + 1] = KEYS[k + 3]
end
-- every job's lease and cancel flag in two commands, not two per job
local leases = call('MGET', unpack(lease_keys))
local cancels = call('MGET', unpack(cancel_keys))
local function write(j, lease_key, events_key, record_key, mode, expected, used, f, n, e, m)
  local length = call('XLEN', events_key)
  if m > 0 and length == expected + m then
    local last = call('XREVRANGE', events_key, '+', '-', 'COUNT', 1)[1]
    if last[2][4] == ARGV[e + 2 * m - 1] then return 1 end
  end
  if length ~= expected or leases[j] ~= ARGV[f - 8] then return 0 end
  if n > 0 then call('HSET', record_key, unpack(ARGV, f, e - 1)) end
  for i = e, e + 2 * m - 1, 2 do
    call('XADD', events_key, '*', 'event', ARGV[i], 'data', ARGV[i + 1])
  end
  if mode ~= '1' then
    call('EXPIRE', record_key, ttl)
    if m > 0 or length > 0 then call('EXPIRE', events_key, ttl) end
  end
  if mode == '3' then
    call('DEL', lease_key)
    call('SREM', running, ARGV[f - 7])
    llmq_end(record_key, jobs_metric, outbox, ARGV[f - 7], used)
  end
  return 1
end
local out = {}
local a = 2
for j = 1, #lease_keys do
  local k = 4 * j
  local mode, n, m = ARGV[a + 2], tonumber(ARGV[a + 6]), tonumber(ARGV[a + 7])
  local f = a + 8
  local e = f + 2 * n
  local done = 1
  if mode ~= '0' then
    done = write(j, KEYS[k], KEYS[k + 1], KEYS[k + 2], mode, tonumber(ARGV[a + 3]),
                 tonumber(ARGV[a + 4]), f, n, e, m)
  end
  local cancel = '0'
  if ARGV[a + 5] == '1' and cancels[j] then cancel = '1' end
  out[j] = done .. cancel
  a = e + 2 * m
end
return table.concat(out)
"""
)
STEP_CHECK_ONLY = "0"  # nothing to write: only the cancel flag is read
STEP_WRITE = "1"  # events and fields under the lease
STEP_FIRST_WRITE = "2"  # the same, and the record's and stream's TTLs set
STEP_FINAL = "3"  # the job's last write: TTLs set, lease given up, end counted


# KEYS: lease. ARGV: expected lease. Deletes it if it is that lease: 1 if so, else 0.
_GIVE_UP = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: lease. ARGV: expected lease, TTL (ms). 1 if renewed, 0 if the lease is not ours.
_RENEW = """
local lease_key, lease, lease_ms = KEYS[1], ARGV[1], ARGV[2]
if redis.call('GET', lease_key) == lease then return redis.call('PEXPIRE', lease_key, lease_ms) end
return 0
"""

# KEYS: lease, RQ queue, running set, RQ job hash, record, the queue's level set, RQ's set
# of queue keys. ARGV: expected lease, job id, level separator. Puts the job back at the
# front of where its priority waits (the record's `priority`: the queue, or its level list,
# as `keys.level_queue_name`), as queued, and gives up the lease. Only a job still in the
# running set is put back, so two requeues of one run push it once: two reapers that both
# saw it without a lease, the second taking its lock after the first had requeued it (its
# lock is given up then). An empty expected lease: the lease is on the events cluster and
# was checked there (`recovery.requeue`).
_REQUEUE = """
local lease_key, queue, running, rq_job, record, levels, queues_set = unpack(KEYS)
local lease, job_id, separator = ARGV[1], ARGV[2], ARGV[3]
local held = lease ~= '' and redis.call('GET', lease_key) == lease
if redis.call('SISMEMBER', running, job_id) == 0 then
  if held then redis.call('DEL', lease_key) end
  return 0
end
if lease ~= '' and not held then return 0 end
local priority = tonumber(redis.call('HGET', record, 'priority') or '0') or 0
if priority ~= 0 then
  queue = queue .. separator .. priority
  redis.call('ZADD', levels, priority, priority)
  redis.call('SADD', queues_set, queue)
end
redis.call('LPUSH', queue, job_id)
redis.call('SREM', running, job_id)
if redis.call('EXISTS', rq_job) == 1 then redis.call('HSET', rq_job, 'status', 'queued') end
if redis.call('EXISTS', record) == 1 then redis.call('HSET', record, 'status', 'queued') end
redis.call('DEL', lease_key)
return 1
"""


# KEYS: source queue, destination queue, RQ's set of queue keys. Moves every id, in order,
# to the front of the destination, then drops the emptied source from RQ's queue set; all
# at once, so no job is ever on neither queue (or on both).
_RELEASE = """
local source, target, queues_set = unpack(KEYS)
local moved = 0
while redis.call('RPOPLPUSH', source, target) do moved = moved + 1 end
redis.call('SREM', queues_set, source)
return moved
"""


APPEND = LoadedScript(_APPEND)
RENEW = LoadedScript(_RENEW)  # by hash on an events cluster (`workers.leases`)
WRITE_STEP = LoadedScript(_WRITE_STEP)


def step_entry(
    job_id: str,
    lease: str,
    mode: str,
    expected_length: int = 0,
    events: Sequence[tuple[str, str]] = (),
    fields: dict[str, str] | None = None,
    used_tokens: int | None = None,
    check_cancel: bool = True,
) -> tuple[list[str], list[Any]]:
    """One job's part of a `write_step` call (`_WRITE_STEP`): its keys and its arguments."""
    fields = fields or {}
    used = "" if used_tokens is None else used_tokens
    args: list[Any] = [lease, job_id, mode, expected_length, used, "1" if check_cancel else "0"]
    args += [len(fields), len(events)]
    for name, value in fields.items():
        args += [name, value]
    for kind, data in events:
        args += [kind, data]
    job_keys = [keys.job_lease(job_id), keys.job_events(job_id), keys.job(job_id)]
    job_keys.append(keys.job_cancel(job_id))
    return job_keys, args


def step_call(
    entries: Sequence[tuple[list[str], list[Any]]], ttl: int = JOB_TTL_SECONDS
) -> tuple[list[str], list[Any]]:
    """The keys and arguments of one `_WRITE_STEP` call over `step_entry` parts."""
    all_keys: list[str] = [keys.RUNNING, keys.METRIC_JOBS, keys.WEBHOOK_OUTBOX]
    args: list[Any] = [ttl]
    for job_keys, job_args in entries:
        all_keys += job_keys
        args += job_args
    return all_keys, args


def write_step(
    client: Any, entries: Sequence[tuple[list[str], list[Any]]], ttl: int = JOB_TTL_SECONDS
) -> list[tuple[bool, bool]]:
    """Every job's writes of one step (`step_entry` each) in one script call on a client:
    (written, cancel flag set) per job, in order (`written` False: the lease or the stream
    was not as expected, and nothing was written for it)."""
    return step_results(WRITE_STEP(client, *step_call(entries, ttl)))


def step_results(reply: bytes | str) -> list[tuple[bool, bool]]:
    """`_WRITE_STEP`'s reply as (written, cancel flag set) per job."""
    flags = reply.decode() if isinstance(reply, bytes) else reply
    return [(flags[i] == "1", flags[i + 1] == "1") for i in range(0, len(flags), 2)]


def claim(
    client: Any,
    queue_keys: Sequence[str],
    worker: str,
    lease_ms: int,
    levels_keys: Sequence[str] | None = None,
    kind_ranks: Sequence[int] | None = None,
) -> tuple[int, str, int] | None:
    """Pop the job that comes first by (kind rank, priority, queue order) from the queues
    and their priority levels (`_CLAIM`): (queue index, job id, attempt|code). Without
    `levels_keys` each queue's own level set is read (`keys.queue_levels` of its name);
    without `kind_ranks` every queue has rank 0 (pure priority, then queue order)."""
    if not queue_keys:
        return None
    if levels_keys is None:
        levels_keys = [keys.queue_levels(_queue_name(k)) for k in queue_keys]
    ranks = list(kind_ranks) if kind_ranks is not None else [0] * len(queue_keys)
    args = [keys.RUNNING, keys.JOB_KEY_PREFIX, ",".join(keys.BUCKET_TAGS), keys.LEASE_SUFFIX]
    args.append(keys.CANCEL_SUFFIX)
    args += [worker, lease_ms, keys.LEVEL_SEPARATOR, *ranks]
    found = client.eval(_CLAIM, 2 * len(queue_keys), *queue_keys, *levels_keys, *args)
    if not found:
        return None
    index, job_id, attempt = found
    job_id = job_id.decode() if isinstance(job_id, bytes) else job_id
    return int(index) - 1, job_id, int(attempt)


def append(
    client: Any,
    job_id: str,
    lease: str,
    expected_length: int,
    events: Sequence[tuple[str, str]],
    fields: dict[str, str] | None = None,
    final: bool = False,
    ttl: int = JOB_TTL_SECONDS,
    used_tokens: int | None = None,
) -> Any:
    """Fenced write: record fields and stream events (`wire.events.Event`); `final`
    also gives up the lease, leaves the running set, counts the job in `METRIC_JOBS`
    under the status `fields` give it and, given `used_tokens` (prompt + completion tokens
    the job really used), settles its rate-limit reservation. On a pipeline the result
    comes back from `execute()`: None when the job is no longer this writer's."""
    fields = fields or {}
    used = "" if used_tokens is None else used_tokens
    argv: list[Any] = [lease, job_id, ttl, "1" if final else "0", expected_length, len(fields)]
    argv.append(used)
    for name, value in fields.items():
        argv += [name, value]
    for kind, data in events:
        argv += [kind, data]
    job_keys = [
        keys.job_lease(job_id),
        keys.job_events(job_id),
        keys.job(job_id),
        keys.RUNNING,
        keys.METRIC_JOBS,
        keys.WEBHOOK_OUTBOX,
    ]
    if hasattr(client, "command_stack"):  # a pipeline: no NOSCRIPT retry there
        return client.eval(_APPEND, len(job_keys), *job_keys, *argv)
    return APPEND(client, job_keys, argv)


def renew(client: Any, job_id: str, lease: str, lease_ms: int) -> Any:
    """Extend `lease` on the job by `lease_ms` if it is still the job's lease (`_RENEW`):
    1 if renewed, 0 if another worker holds the job now."""
    return client.eval(_RENEW, 1, keys.job_lease(job_id), lease, lease_ms)


def give_up(client: Any, job_id: str, lease: str) -> int:
    """Delete the job's lease if it is still `lease` (`_GIVE_UP`): 1 if deleted."""
    return int(client.eval(_GIVE_UP, 1, keys.job_lease(job_id), lease))


def requeue(client: Any, job_id: str, lease: str, queue_key: str, rq_job_key: str) -> Any:
    """Put the job back at the front of `queue_key` (or of its level list, by the record's
    priority), queued, and give up `lease` (`_REQUEUE`); 1 if done, 0 if `lease` was not the
    job's lease or the job is not running (requeued already)."""
    job_keys = [
        keys.job_lease(job_id),
        queue_key,
        keys.RUNNING,
        rq_job_key,
        keys.job(job_id),
        keys.queue_levels(_queue_name(queue_key)),
        RQ_QUEUES_KEY,
    ]
    return client.eval(_REQUEUE, len(job_keys), *job_keys, lease, job_id, keys.LEVEL_SEPARATOR)


def _queue_name(queue_key: str) -> str:
    """An RQ queue's name from its key (`rq:queue:{name}`)."""
    return queue_key.removeprefix(RQ_QUEUE_PREFIX)


def release(client: Any, source_key: str, target_key: str, queues_key: str) -> int:
    """Move every job id of one queue to the front of another (`_RELEASE`); how many."""
    return int(client.eval(_RELEASE, 3, source_key, target_key, queues_key))
