"""Per-caller rate limits in Redis: the buckets' Lua, shared by the API and the workers.

Each caller (an API key, or a client address when /v1 has no keys) has two buckets in one
hash (`keys.rate_limit`): requests and tokens per minute. A bucket is a GCRA token bucket:
its capacity is the per-minute limit and it refills continuously, one unit every
`60 s / limit`. It is stored as one number, the time (ms, Redis TIME, so API machines'
clocks do not matter) at which it is full again; a unit taken moves that time one
interval later, and a bucket whose time is past is full and not stored at all. So a
check, its charge and the headers' figures are one script and one round trip, and a caller
who stops sending leaves no key behind (PEXPIREAT at the later of the two times).

A submission reserves prompt tokens + the most it may generate (`charge`); the job's
record carries the reservation (`Reservation`), and the write that ends the job settles it
to what the job really used (`SETTLE_LUA`'s `llmq_settle`, called from the worker's fenced
final write, `workers.scripts._APPEND`, and by `settle` for a job ended while queued). The
settlement deletes the record's reservation fields, so a repeated end settles nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers import keys

WINDOW_MS = 60_000  # limits are per minute: an empty bucket is full again after this long
REQUESTS, TOKENS = "requests", "tokens"  # the buckets' fields, and OpenAI's names for them

# the job record's fields of a reservation (`workers.wire.job.JobRecord` has them too)
KEY_FIELD, TOKENS_FIELD, TOKEN_MS_FIELD = "ratelimit_key", "ratelimit_tokens", "ratelimit_token_ms"

# Helpers every bucket script starts with. A bucket field holds the ms at which it is full
# again; `llmq_after` adds `cost` units (negative: given back) to what it holds now, never
# below now, since a bucket holds at most its capacity.
PRELUDE = f"""
local LLMQ_WINDOW_MS = {WINDOW_MS}
local function llmq_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
end
local function llmq_after(full_at, now, per_ms, cost)
  return math.max(math.max(full_at or now, now) + cost * per_ms, now)
end
local function llmq_store(bucket, field, full_at, now)
  if full_at > now then
    redis.call('HSET', bucket, field, string.format('%.17g', full_at))
  else
    redis.call('HDEL', bucket, field)
  end
end
local function llmq_expire(bucket, now)
  local latest = now
  for _, value in ipairs(redis.call('HVALS', bucket)) do
    latest = math.max(latest, tonumber(value) or now)
  end
  if latest > now then
    redis.call('PEXPIREAT', bucket, math.ceil(latest) + 1)
  else
    redis.call('DEL', bucket)
  end
end
"""

# `llmq_settle(record, used)`: charge the tokens bucket named on a job's record with what the
# job used instead of what it reserved, once (the reservation fields are deleted). A bucket
# name that is not a rate-limit key is ignored: a record never points a script elsewhere.
SETTLE_LUA = (
    PRELUDE
    + f"""
local function llmq_settle(record_key, used)
  local held = redis.call('HMGET', record_key, '{KEY_FIELD}', '{TOKENS_FIELD}', '{TOKEN_MS_FIELD}')
  local bucket, reserved, per_ms = held[1], tonumber(held[2]), tonumber(held[3])
  if not bucket or not reserved or not per_ms then return 0 end
  redis.call('HDEL', record_key, '{KEY_FIELD}', '{TOKENS_FIELD}', '{TOKEN_MS_FIELD}')
  local prefix = '{keys.RATE_LIMIT_PREFIX}'
  if string.sub(bucket, 1, #prefix) ~= prefix then return 0 end
  local now = llmq_now_ms()
  local full_at = tonumber(redis.call('HGET', bucket, '{TOKENS}'))
  llmq_store(bucket, '{TOKENS}', llmq_after(full_at, now, per_ms, used - reserved), now)
  llmq_expire(bucket, now)
  return 1
end
"""
)

# KEYS: the caller's bucket hash. ARGV: requests limit, tokens limit (0: that limit is off),
# requests cost, tokens cost (0 for a look that changes nothing; negative gives back).
# Refused when either bucket would hold more than a minute's work; then nothing is taken.
# Returns {refused by (0 none, 1 requests, 2 tokens), ms until it would be allowed,
# requests remaining, requests reset ms, tokens remaining, tokens reset ms}.
_CHARGE = (
    PRELUDE
    + f"""
local bucket = KEYS[1]
local limits = {{tonumber(ARGV[1]), tonumber(ARGV[2])}}
local costs = {{tonumber(ARGV[3]), tonumber(ARGV[4])}}
local fields = {{'{REQUESTS}', '{TOKENS}'}}
local now = llmq_now_ms()
local held = redis.call('HMGET', bucket, fields[1], fields[2])
local at, wait, refused_by = {{}}, 0, 0
for i = 1, 2 do
  if limits[i] > 0 then
    at[i] = llmq_after(tonumber(held[i]), now, LLMQ_WINDOW_MS / limits[i], costs[i])
    local over = at[i] - now - LLMQ_WINDOW_MS
    if over > 1e-6 and over > wait then wait, refused_by = over, i end
  end
end
local changed = false
for i = 1, 2 do
  if limits[i] > 0 then
    if refused_by > 0 then
      at[i] = llmq_after(tonumber(held[i]), now, 0, 0)
    elseif costs[i] ~= 0 then
      llmq_store(bucket, fields[i], at[i], now)
      changed = true
    end
  end
end
if changed then llmq_expire(bucket, now) end
local out = {{refused_by, math.ceil(wait)}}
for i = 1, 2 do
  local remaining, reset = 0, 0
  if limits[i] > 0 then
    local busy = at[i] - now
    remaining = math.max(0, math.floor((LLMQ_WINDOW_MS - busy) * limits[i] / LLMQ_WINDOW_MS + 1e-6))
    reset = math.ceil(busy)
  end
  out[#out + 1] = remaining
  out[#out + 1] = reset
end
return out
"""
)

_SETTLE = (
    SETTLE_LUA
    + """
return llmq_settle(KEYS[1], tonumber(ARGV[1]))
"""
)


@dataclass(frozen=True)
class Bucket:
    """One bucket as a caller sees it now: OpenAI's `x-ratelimit-*-{name}` figures."""

    name: str  # REQUESTS or TOKENS
    limit: int
    remaining: int
    reset_ms: int  # until the bucket is full again


@dataclass(frozen=True)
class Charge:
    """What `charge` did: `refused_by` is None when the costs were taken, else the bucket
    that lacked room (nothing was taken), and `retry_after_ms` when it will have it.
    `buckets` are the limits that are on, after the charge."""

    refused_by: str | None
    retry_after_ms: int
    buckets: tuple[Bucket, ...]


@dataclass(frozen=True)
class Reservation:
    """The tokens a job reserved in a caller's bucket, kept on its record until its end
    settles them: the bucket's key, the tokens, and ms per token (60000 / the limit)."""

    bucket: str
    tokens: int
    token_ms: float

    def to_fields(self) -> dict[str, str]:
        return {
            KEY_FIELD: self.bucket,
            TOKENS_FIELD: str(self.tokens),
            TOKEN_MS_FIELD: repr(self.token_ms),
        }


def charge(client: Any, bucket: str, limits: tuple[int, int], costs: tuple[int, int]) -> Charge:
    """Take `costs` (requests, tokens) from `bucket` if both fit under `limits` (requests
    and tokens per minute, 0 for off), in one round trip; costs of 0 only look."""
    reply = client.eval(_CHARGE, 1, bucket, *limits, *costs)
    refused_by, wait, *figures = (int(v) for v in reply)
    buckets = tuple(
        Bucket(name, limit, figures[2 * i], figures[2 * i + 1])
        for i, (name, limit) in enumerate(zip((REQUESTS, TOKENS), limits, strict=True))
        if limit > 0
    )
    refused = (None, REQUESTS, TOKENS)[refused_by]
    return Charge(refused, wait if refused else 0, buckets)


def settle(client: Any, job_id: str, used: int) -> Any:
    """Settle the reservation on a job's record at `used` tokens (`llmq_settle`): for a job
    ended outside the worker's fenced final write, such as one cancelled while queued
    (used 0). A job without a reservation is left alone; on a pipeline the answer comes
    from `execute()` (1 if a reservation was settled, else 0)."""
    return client.eval(_SETTLE, 1, keys.job(job_id), used)
