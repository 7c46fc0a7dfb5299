"""The submission gate: the queue-depth check and the push of a job id, in one step on
the server, so concurrent submits from any number of API processes never push past the
limit (docs/faults.md, F10) and a job id is on a queue only if its record exists.

`gate_submission` is the only caller of the script: it lays out KEYS and ARGV from two
dataclasses whose fields are named in the order the script unpacks them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from workers import keys
from workers.wire.broker import NotReplicated, Replication
from workers.wire.defaults import JOB_TTL_SECONDS, WAKE_MAX_TOKENS, WAKE_TTL_SECONDS
from workers.wire.job import QUEUED
from workers.wire.loaded_script import LoadedScript
from workers.wire.wake import WAKE_TOKEN


@dataclass(frozen=True)
class GateKeys:
    shared_queue: str  # the model's shared RQ queue
    queues_set: str  # RQ's set of queue keys (`rq info` lists queues from it)
    record: str  # the job's record
    rq_job: str  # the job's RQ hash
    own_queue: str  # a worker's own queue to prefer, '' for none
    shared_wake: str  # the wake list of the shared queue
    own_wake: str  # the wake list of the own queue (the shared one's if none)
    jobs_metric: str  # the jobs counter
    owner_index: str  # the owner's index of jobs, '' for none
    levels: str  # the shared queue's set of priority levels (`keys.queue_levels`)
    refused: str  # set for a minute when the queues were full (`keys.refused_submission`)


@dataclass(frozen=True, kw_only=True)
class GateArgs:
    """What one submission passes; the fields with defaults are the same for every job."""

    max_queue: int  # 0: no limit
    job_id: str
    own_prefix: str  # prefix of the model's own queues, '' to count only the shared one
    own_room: int  # how many jobs the own queue may hold
    created_at: float  # the index's score of this job
    index_cutoff: float  # index entries scored below this are dropped
    index_ttl: int = JOB_TTL_SECONDS
    wake_token: str = WAKE_TOKEN
    wake_max_tokens: int = WAKE_MAX_TOKENS
    wake_ttl: int = WAKE_TTL_SECONDS
    counted_status: str = QUEUED  # the jobs counter's field
    own_queue_name: str  # written to the record when the own queue is chosen
    priority: int = 0  # not 0: the job waits on the shared queue's level list
    level_separator: str = keys.LEVEL_SEPARATOR


_FIELD_NAMES = {cls: tuple(f.name for f in fields(cls)) for cls in (GateKeys, GateArgs)}

# The depth counts the shared queue, its priority levels and (with `own_prefix`) the own
# queues. A job with a priority other than 0 waits on its level list (`keys.level_queue_name`,
# whose name the script builds the same way) and its level joins the level set.
# Returns {1 shared | 2 own, depth}, or {0, depth} when full, after deleting the record and
# RQ's hash, or {-1, 0} when the record is not there: written to a master that has since
# failed over without passing it on (`wire.broker`), so pushing the id would queue nothing.
# Run again for the same record it pushes nothing and answers as it did (a refusal leaves
# the `refused` key, holding the depth, for a minute; a push answers with depth 0): the
# API's client retries a command whose reply it lost (redis-py's default retry, kept for
# the reads), and a second push would hand the job to two workers.
_GATE = """
local shared_queue, queues_set, record, rq_job, own_queue, shared_wake, own_wake,
      jobs_metric, owner_index, levels, refused = unpack(KEYS)
local max_queue, job_id, own_prefix, own_room, created_at, index_cutoff, index_ttl,
      wake_token, wake_max_tokens, wake_ttl, counted_status, own_queue_name, priority,
      separator = unpack(ARGV)
if redis.call('EXISTS', record) == 0 then
  local full = redis.call('GET', refused)
  if full then return {0, tonumber(full)} end
  return {-1, 0}
end
local gated = redis.call('HGET', record, 'gated')
if gated then return {tonumber(gated), 0} end
local depth = redis.call('LLEN', shared_queue)
for _, level in ipairs(redis.call('ZRANGE', levels, 0, -1)) do
  depth = depth + redis.call('LLEN', shared_queue .. separator .. level)
end
if own_prefix ~= '' then
  for _, queue in ipairs(redis.call('SMEMBERS', queues_set)) do
    if string.sub(queue, 1, #own_prefix) == own_prefix then
      depth = depth + redis.call('LLEN', queue)
    end
  end
end
local limit = tonumber(max_queue)
if limit > 0 and depth >= limit then
  redis.call('DEL', record, rq_job)
  redis.call('SET', refused, depth, 'EX', 60)
  return {0, depth}
end
local target, wake, chosen = shared_queue, shared_wake, 1
if priority ~= '0' then
  target = shared_queue .. separator .. priority
  redis.call('ZADD', levels, priority, priority)
elseif own_queue ~= '' and redis.call('LLEN', own_queue) < tonumber(own_room) then
  target, wake, chosen = own_queue, own_wake, 2
  redis.call('HSET', record, 'queue', own_queue_name)
end
redis.call('RPUSH', target, job_id)
redis.call('HSET', record, 'gated', chosen)
redis.call('SADD', queues_set, target)
redis.call('LPUSH', wake, wake_token)
redis.call('LTRIM', wake, 0, tonumber(wake_max_tokens) - 1)
redis.call('EXPIRE', wake, wake_ttl)
redis.call('HINCRBY', jobs_metric, counted_status, 1)
if owner_index ~= '' then
  redis.call('ZADD', owner_index, created_at, job_id)
  redis.call('ZREMRANGEBYSCORE', owner_index, '-inf', index_cutoff)
  redis.call('EXPIRE', owner_index, index_ttl)
end
return {chosen, depth}
"""


GATE = LoadedScript(_GATE)  # by hash: its text is ~2.5 KB, sent with every submission by EVAL


def _values(fields_of: Any) -> list[Any]:
    """A dataclass's values in field order: `astuple` deep-copies, and this runs per submission."""
    return [getattr(fields_of, name) for name in _FIELD_NAMES[type(fields_of)]]


def gate_submission(
    client: Any, gate_keys: GateKeys, args: GateArgs, replication: Replication | None = None
) -> tuple[int, int]:
    """Push `args.job_id` unless the queues are full: (0 full | 1 shared | 2 own, depth).
    With `replication` on, `WAIT` follows on the same connection, so the answer also says
    the record and the push are on enough replicas (else `NotReplicated`)."""
    keys_, argv = _values(gate_keys), _values(args)
    replication = replication or Replication()
    if not replication.on:
        chosen, depth = GATE(client, keys_, argv)
    else:
        gated, acked = GATE.before(client, keys_, argv, replication.wait_in)
        if isinstance(gated, Exception):
            raise gated
        if isinstance(acked, Exception):
            raise acked
        chosen, depth = gated
        if int(chosen) > 0:
            replication.check(acked)
    if int(chosen) == -1:
        raise NotReplicated(0, replication.min_replicas, gate_keys.record)
    return int(chosen), int(depth)
