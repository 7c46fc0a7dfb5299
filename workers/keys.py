"""Every Redis key, channel and RQ queue name llmq uses, in one place (like rq's `key_for`).

Shared by `api/` and `workers/`; nothing else builds key strings. This module imports only
the standard library, so the API can use it without pulling in the engine.

Layout:
- `llmq:job:{id}`            hash: the job record (see `workers.wire.job.JobRecord`)
- `llmq:job:{<tag>}:{id}:events` stream: token/done/error events; entry ids are the SSE ids
- `llmq:job:{id}:cancel`     string flag: the decode loop stops the job when it is set
- `llmq:job:{<tag>}:{id}:lease` string "{worker}:{attempt}" with a short TTL, renewed while
                             running. The stream and the lease that fences it carry the tag
                             of the job's event bucket (`event_bucket`, `BUCKET_TAGS`) as a
                             Redis Cluster hash tag, so on the events cluster
                             (`LLMQ_EVENTS_CLUSTER`, `wire.broker.EventsSettings`) both live
                             in one hash slot and one script reads and writes them together,
                             and a reader can XREAD every followed stream of a bucket in one
                             call (a cluster refuses a command whose keys span slots, so one
                             tag per job would cost one XREAD per stream). On one Redis the
                             tag is only part of the name. Every other key stays on the queue
                             Redis
- `llmq:running`             set of job ids a worker has started and not finished
- `llmq:workers`             set of worker names; `llmq:worker:{name}` hash, TTL'd heartbeat
                             (fields: `workers.wire.worker_info.WorkerInfo`)
- `llmq:worker:{name}:commands` list of JSON admin commands for that worker (LPUSH by the
                             API, popped by the worker; `workers.wire.commands.encode_command`)
- `llmq:wake:{queue}`        list of wake tokens for an RQ queue (`queue_wake`): whoever
                             puts a job on the queue pushes one in the same transaction
                             (`wire.wake.push_wake`), and an idle worker BLPOPs the wake lists
                             of its queues with its commands, so it starts the job at once
                             instead of at the end of its poll; bounded, with a short TTL
- `llmq:models`              hash model id -> JSON of where its file is (published by workers)
- `llmq:idempotency:{key}`   string job id, for `Idempotency-Key` resubmits
- `llmq:refused:{id}`        string, for a minute: the submission gate found the queues full
                             for this job, so a retried gate answers the same (`api.gate`)
- `llmq:replication:mark`    counter: the write `WAIT` waits for when an acknowledgement
                             must be replicated (`wire.broker.Replication.confirm`; Sentinel)
- `llmq:api:{reader}:wake`   stream (MAXLEN 1, short TTL): wakes one API process's stream
                             reader out of its blocking XREAD when a client starts following
                             a job (`api.stream_hub`); `{reader}` is random per process
- `llmq:metrics:*`           counters and histograms shared by every API and worker process
                             (the `METRIC_*` names below; no TTL, never any prompt text)
- `llmq:metrics:history`     stream: a sample of those every few seconds, the last 15 minutes
                             (`workers.wire.history.MetricsSample`; entry id = the sample's
                             slot, so two workers never both add one; MAXLEN-bounded)
- `llmq:affinity:{model}:{digest}` string: the worker that last ran a request with this
                             `wire.prefix.prefix_digest` (TTL `wire.defaults.AFFINITY_TTL_SECONDS`)
- `llmq:ratelimit:{caller}`  hash: one caller's rate-limit buckets (`wire.rate_limit`; caller
                             `key:{owner digest}` or `addr:{client address}`): fields
                             `requests` and `tokens`, each the time in ms (Redis TIME) at which
                             that bucket is full again; the key expires then (PEXPIREAT), so an
                             idle caller leaves nothing. A job that reserved tokens names its
                             bucket on its record (`ratelimit_key`), where the script that ends
                             the job reads it to settle the reservation
- RQ queues `llmq-{model}-interactive` and `llmq-{model}-batch` (shared by every worker that
  serves the model), and `llmq-{model}-interactive@{worker}`: that worker's own queue, where
  the API routes jobs whose prefix it holds (`workers.affinity`); for RQ those are still
  jobs of the shared queue (their origin), the own queue only decides who takes them
- `llmq-{model}-{kind}:p{priority}`: the jobs of a shared queue whose `priority` is not 0
  (`level_queue_name`; level 0 is the queue itself), and `llmq:levels:{queue}` the sorted
  set of the levels that may hold jobs (member and score: the priority). Like own queues,
  levels only decide the order workers take jobs in (`scripts.claim`); RQ's origin is the
  shared queue

Offline batches (OpenAI's Files and Batch APIs; `workers.wire.batches` has the record types):
- `llmq:file:{id}`            hash: a file's metadata (`workers.wire.batches.FileRecord`)
- `llmq:file:{id}:content`    string: the file's bytes (input JSONL, or a batch's output)
- `llmq:files`                sorted set file id -> created_at, for listing
- `llmq:batch:{id}`           hash: the batch (`workers.wire.batches.BatchRecord`)
- `llmq:batch:{id}:lines`     list: line numbers of the valid requests, in file order
- `llmq:batch:{id}:requests`  hash line -> JSON `{custom_id, model, request}` (prompt text)
- `llmq:batch:{id}:inflight`  set of line numbers enqueued as jobs and not yet collected
- `llmq:batch:{id}:output`    hash line -> output-file JSONL line (successes)
- `llmq:batch:{id}:errors`    hash line -> error-file JSONL line (invalid or failed lines)
- `llmq:batches`              sorted set batch id -> created_at, for listing
- `llmq:batches:active`       set of batch ids the batch driver still has to move on
- `llmq:batches:lock`         string: the worker running the batch driver right now (TTL)
The job of line N of batch B has the id `batch_job_id(B, N)`, so re-feeding is a no-op.
"""

from __future__ import annotations

import re
from collections.abc import Callable

PREFIX = "llmq"
REPLICATION_MARK = f"{PREFIX}:replication:mark"
JOB_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # RQ's own id alphabet, bounded
# queue kinds: `batch` holds only the jobs of Batch API lines (`workers.batches`); every
# other job is `interactive`
INTERACTIVE, BATCH = "interactive", "batch"
QUEUE_KINDS = (INTERACTIVE, BATCH)  # workers serve them in this order
OWNER_SEPARATOR = "@"  # between a queue's name and its worker in `personal_queue_name`
LEVEL_SEPARATOR = ":p"  # between a shared queue's name and a priority in `level_queue_name`
# `priority` is a signed 32-bit integer: Redis scores and Lua numbers (doubles) hold every
# one exactly, and batch work sorts below all of them (`scheduling_priority`)
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1

# Lua scripts that learn a job id inside Redis build its keys from these parts, so the
# layout is still named only here: job(id) == JOB_KEY_PREFIX + id, job_lease(id) ==
# JOB_KEY_PREFIX + bucket_tag(event_bucket(id)) + ":" + id + LEASE_SUFFIX, job_cancel(id) ==
# JOB_KEY_PREFIX + id + CANCEL_SUFFIX.
JOB_KEY_PREFIX = f"{PREFIX}:job:"
LEASE_SUFFIX = ":lease"  # after the bucket's tag and the id: `job_lease`
CANCEL_SUFFIX = ":cancel"
# Event buckets: the hash slots the jobs' streams and leases are spread over on an events
# cluster, one blocking XREAD (one connection) per followed bucket in each API process.
# Fixed for a fleet (the key names depend on them). Bucket b's tag hashes to a slot in the
# b-th 32nd of the 16,384 (tests/workers/test_events_cluster.py checks it), so a cluster
# whose nodes hold equal runs of slots (`redis-cli --cluster create`, 2, 4, 8, 16 or 32
# shards exactly; 3 within one bucket) holds equal shares of the buckets.
BUCKET_TAGS = (
    "e0.72",
    "e1.40",
    "e2.131",
    "e3.33",
    "e4.61",
    "e5.53",
    "e6.12",
    "e7.20",
    "e8.42",
    "e9.70",
    "e10.42",
    "e11.70",
    "e12.0",
    "e13.72",
    "e14.51",
    "e15.63",
    "e16.50",
    "e17.1",
    "e18.70",
    "e19.42",
    "e20.50",
    "e21.3",
    "e22.23",
    "e23.11",
    "e24.0",
    "e25.70",
    "e26.31",
    "e27.120",
    "e28.60",
    "e29.52",
    "e30.153",
    "e31.32",
)
EVENT_BUCKETS = len(BUCKET_TAGS)

RUNNING = f"{PREFIX}:running"
WORKERS = f"{PREFIX}:workers"
MODELS = f"{PREFIX}:models"
LORAS = f"{PREFIX}:loras"  # hash: adapter name -> JSON {name, path, base_model} (/admin/loras)
FILES = f"{PREFIX}:files"
BATCHES = f"{PREFIX}:batches"
JOBS = f"{PREFIX}:jobs"  # sorted set: job id -> created_at, the jobs of an open /v1
BATCHES_ACTIVE = f"{PREFIX}:batches:active"
BATCHES_LOCK = f"{PREFIX}:batches:lock"
FILE_ID_PATTERN = re.compile(r"^file-[A-Za-z0-9]{1,64}$")
BATCH_ID_PATTERN = re.compile(r"^batch_[A-Za-z0-9]{1,48}$")


def is_valid_job_id(job_id: str) -> bool:
    return bool(JOB_ID_PATTERN.match(job_id))


def jobs_of(owner: str | None) -> str:
    """The index of one API key's jobs (`GET /v1/jobs`); `JOBS` when /v1 is open."""
    return JOBS if owner is None else f"{JOBS}:owner:{owner}"


def _key_of(family: str, suffix: str = "") -> Callable[[str], str]:
    """The builder of one kind of per-id key, `llmq:{family}:{id}{suffix}`: one line each
    below, so the key layout reads as the table in this module's docstring."""
    head = f"{PREFIX}:{family}:"

    def key(ident: str) -> str:
        return f"{head}{ident}{suffix}"

    return key


job = _key_of("job")  # == JOB_KEY_PREFIX + id, as the Lua scripts build it
job_cancel = _key_of("job", CANCEL_SUFFIX)


def event_bucket(job_id: str) -> int:
    """The job's event bucket: a hash of its id that Lua computes the same way
    (`scripts._CLAIM` names the lease of the job it pops)."""
    h = 0
    for byte in job_id.encode():
        h = (h * 31 + byte) % 65536
    return (h * 40503) % 65536 * EVENT_BUCKETS // 65536  # Knuth's multiplier: high bits


def bucket_tag(bucket: int) -> str:
    """The hash tag of an event bucket: every key with it is in one slot."""
    return f"{{{BUCKET_TAGS[bucket]}}}"


def events_prefix(job_id: str) -> str:
    return f"{JOB_KEY_PREFIX}{bucket_tag(event_bucket(job_id))}:{job_id}"


def job_events(job_id: str) -> str:
    return f"{events_prefix(job_id)}:events"


def job_lease(job_id: str) -> str:
    """In the hash slot of `job_events`: the fenced append reads both in one script."""
    return f"{events_prefix(job_id)}{LEASE_SUFFIX}"


refused_submission = _key_of("refused")  # of a job id
worker = _key_of("worker")
worker_commands = _key_of("worker", ":commands")
idempotency = _key_of("idempotency")
# One wake list per RQ queue (named by `queue_name` or `personal_queue_name`), so a token
# pushed for a shared queue wakes exactly one of the idle workers blocked on it (BLPOP
# serves one client per element), and the API need not know them.
queue_wake = _key_of("wake")
queue_levels = _key_of("levels")  # of a shared queue's name: its priority levels
file = _key_of("file")
file_content = _key_of("file", ":content")
batch = _key_of("batch")
batch_lines = _key_of("batch", ":lines")
batch_requests = _key_of("batch", ":requests")
batch_inflight = _key_of("batch", ":inflight")
batch_output = _key_of("batch", ":output")
batch_errors = _key_of("batch", ":errors")
metric = _key_of("metrics")
rate_limit = _key_of("ratelimit")  # == RATE_LIMIT_PREFIX + caller
api_wake = _key_of("api", ":wake")  # of an API process's stream reader (`api.stream_hub`)


def api_wake_in(bucket: int, ident: str) -> str:
    """A stream reader's wake stream in an event bucket's slot: on an events cluster a
    reader XREADs one bucket's streams and its wake stream in one call."""
    return f"{PREFIX}:api:{bucket_tag(bucket)}:{ident}:wake"


RATE_LIMIT_PREFIX = rate_limit("")  # a bucket named on a record must start with it


def batch_job_id(batch_id: str, line: int) -> str:
    """The job of one batch line: deterministic, so feeding a line twice finds its job."""
    return f"{batch_id}-{line}"


def is_valid_file_id(file_id: str) -> bool:
    return bool(FILE_ID_PATTERN.match(file_id))


def is_valid_batch_id(batch_id: str) -> bool:
    return bool(BATCH_ID_PATTERN.match(batch_id))


def affinity(model: str, digest: str) -> str:
    """Which worker holds a prompt prefix: one key per digest, so each entry has its own TTL
    and the set of them needs no size bookkeeping."""
    return f"{PREFIX}:affinity:{model}:{digest}"


# Metrics: hashes, so one HGETALL renders each; the API's /metrics reads them all.
METRIC_REQUESTS = metric("requests")  # "{METHOD} {route}|{status}" -> count (API)
METRIC_JOBS = metric("jobs")  # state -> jobs that reached it (API: queued/cancelled; workers)
METRIC_TOKENS_GENERATED = metric("tokens_generated")  # model -> count (workers, HINCRBY)
METRIC_PROMPT_TOKENS = metric("prompt_tokens")  # model -> count (workers, HINCRBY)
METRIC_TTFT = metric("ttft_seconds")  # histogram by model: wire.histograms.histogram_fields
# histogram by model of the sequences a decode step ran together; the key and the Prometheus
# name (`llmq_batch_size`) keep their published spelling
METRIC_STEP_SIZE = metric("batch_size")
METRIC_TOKENS_PER_SECOND = metric("tokens_per_second")  # worker name -> recent decode tok/s
METRIC_PREFIX_CACHE = metric("prefix_cache")  # "{model}|hit_tokens", "{model}|prompt_tokens"
METRIC_HISTORY = metric("history")  # stream of `wire.history.MetricsSample` (the dashboard)


def queue_name(model: str, kind: str = INTERACTIVE) -> str:
    """RQ queue for a model's jobs; interactive queues are served before batch queues."""
    if kind not in QUEUE_KINDS:
        raise ValueError(f"queue kind must be one of {QUEUE_KINDS}, got {kind!r}")
    return f"{PREFIX}-{model}-{kind}"


def level_queue_name(name: str, priority: int) -> str:
    """Where a shared queue's jobs of `priority` wait: the queue itself for 0, else its level
    list. A worker takes the lowest level first, interactive before batch (`scripts.claim`)."""
    return name if priority == 0 else f"{name}{LEVEL_SEPARATOR}{priority}"


def queue_priority(name: str) -> int:
    """The priority of the jobs waiting on the queue `name` (0 unless it is a level list)."""
    return _split_level(name)[1]


def scheduling_priority(kind: str, priority: int) -> int:
    """The engine's ordering key of a job (lower runs sooner, `runtime.generator`): its
    `priority`, with every batch job after every interactive one."""
    return priority + (PRIORITY_MAX - PRIORITY_MIN + 1 if kind == BATCH else 0)


def personal_queue_name(model: str, worker: str) -> str:
    """A worker's own interactive queue for a model: served before the shared one."""
    return f"{queue_name(model, INTERACTIVE)}{OWNER_SEPARATOR}{worker}"


def parse_queue_name(name: str) -> tuple[str, str]:
    """(model, kind) of a queue named by `queue_name`, `personal_queue_name` or
    `level_queue_name`; ValueError for any other name."""
    base, _ = _split_owner(_split_level(name)[0])
    for kind in QUEUE_KINDS:
        head, suffix = f"{PREFIX}-", f"-{kind}"
        if base.startswith(head) and base.endswith(suffix) and len(base) > len(head + suffix):
            return base[len(head) : -len(suffix)], kind
    raise ValueError(f"not an llmq queue name (llmq-{{model}}-{{kind}}): {name!r}")


def queue_owner(name: str) -> str | None:
    """The worker whose own queue this is, or None for a shared queue."""
    return _split_owner(name)[1]


def shared_queue_name(name: str) -> str:
    """The shared queue of the model and kind of any llmq queue (itself if shared)."""
    return queue_name(*parse_queue_name(name))


def _split_level(name: str) -> tuple[str, int]:
    head, separator, level = name.rpartition(LEVEL_SEPARATOR)
    if not separator or not any(head.endswith(f"-{kind}") for kind in QUEUE_KINDS):
        return name, 0
    try:
        return head, int(level)
    except ValueError:
        return name, 0


def _split_owner(name: str) -> tuple[str, str | None]:
    marker = f"-{INTERACTIVE}{OWNER_SEPARATOR}"
    at = name.find(marker)
    if at < 0 or at + len(marker) == len(name):
        return name, None
    return name[: at + len(marker) - 1], name[at + len(marker) :]


# Webhooks (`workers.wire.webhooks`; admin routes in api/admin.py, delivery in workers/webhooks/):
# - `llmq:webhooks`                hash endpoint id -> JSON endpoint (url, events, secret)
# - `llmq:webhooks:outbox`         stream: one entry per terminal write of a job or batch that
#                                  notifies (fields `kind`, `id`, `status` and, for a
#                                  response, `response_status`), appended by that write
#                                  itself; read by the dispatcher's consumer group
#                                  `WEBHOOK_OUTBOX_GROUP`, XACKed and XDELed once enqueued
# - `llmq:webhooks:{id}:deliveries` list: the endpoint's last deliveries, newest first (capped)
# - RQ queue `llmq:webhooks`: one job per (event, endpoint); its FailedJobRegistry is the
#   dead-letter list. Not a model's queue: its name has no "llmq-" head, so
#   `wire.queues.llmq_queue_names` (the model queues' listing) leaves it out
# - `llmq:webhooks:alive:{name}`   string: an `llmq webhooks` process's lease, short TTL,
#                                  renewed while it lives (workers/webhooks/reaper.py)
# - `llmq:webhooks:takeover:{id}`  string: a reaper's claim on a dead process's delivery
WEBHOOKS = f"{PREFIX}:webhooks"
WEBHOOK_OUTBOX = f"{PREFIX}:webhooks:outbox"
WEBHOOK_OUTBOX_GROUP = "dispatchers"
WEBHOOK_QUEUE = f"{PREFIX}:webhooks"  # RQ's key for it is rq:queue:llmq:webhooks
webhook_deliveries = _key_of("webhooks", ":deliveries")
webhook_alive = _key_of("webhooks:alive")
webhook_takeover = _key_of("webhooks:takeover")
