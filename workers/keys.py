"""Every Redis key, channel and RQ queue name llmq uses, in one place (like rq's `key_for`).

Shared by `api/` and `workers/`; nothing else builds key strings. This module imports only
the standard library, so the API can use it without pulling in the engine.

Layout:
- `llmq:job:{id}`            hash: the job record (see `workers.protocol.JobRecord`)
- `llmq:job:{id}:events`     stream: token/done/error events; entry ids are the SSE ids
- `llmq:job:{id}:wake`       pub/sub channel: "an event was appended" (wake-ups only)
- `llmq:job:{id}:cancel`     string flag: the decode loop stops the job when it is set
- `llmq:job:{id}:lease`      string "{worker}:{attempt}" with a short TTL, renewed while running
- `llmq:running`             set of job ids a worker has started and not finished
- `llmq:workers`             set of worker names; `llmq:worker:{name}` hash, TTL'd heartbeat
                             (fields: `workers.protocol.WorkerInfo`)
- `llmq:worker:{name}:commands` list of JSON admin commands for that worker (LPUSH by the
                             API, popped by the worker; `workers.protocol.encode_command`)
- `llmq:models`              hash model id -> JSON of where its file is (published by workers)
- `llmq:idempotency:{key}`   string job id, for `Idempotency-Key` resubmits
- `llmq:metrics:*`           counters and histograms shared by every API and worker process
                             (the `METRIC_*` names below; no TTL, never any prompt text)
- RQ queues `llmq-{model}-interactive` and `llmq-{model}-batch`
"""

from __future__ import annotations

import re

PREFIX = "llmq"
JOB_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # RQ's own id alphabet, bounded
INTERACTIVE, BATCH = "interactive", "batch"
QUEUE_KINDS = (INTERACTIVE, BATCH)  # workers serve them in this order

# Lua scripts that learn a job id inside Redis build its keys from these parts, so the
# layout is still named only here: job(id) == JOB_KEY_PREFIX + id, job_lease(id) ==
# JOB_KEY_PREFIX + id + LEASE_SUFFIX, job_cancel(id) == JOB_KEY_PREFIX + id + CANCEL_SUFFIX.
JOB_KEY_PREFIX = f"{PREFIX}:job:"
LEASE_SUFFIX = ":lease"
CANCEL_SUFFIX = ":cancel"

RUNNING = f"{PREFIX}:running"
WORKERS = f"{PREFIX}:workers"
MODELS = f"{PREFIX}:models"


def is_valid_job_id(job_id: str) -> bool:
    return bool(JOB_ID_PATTERN.match(job_id))


def job(job_id: str) -> str:
    return f"{JOB_KEY_PREFIX}{job_id}"


def job_events(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:events"


def job_wake(job_id: str) -> str:
    return f"{PREFIX}:job:{job_id}:wake"


def job_cancel(job_id: str) -> str:
    return f"{JOB_KEY_PREFIX}{job_id}{CANCEL_SUFFIX}"


def job_lease(job_id: str) -> str:
    return f"{JOB_KEY_PREFIX}{job_id}{LEASE_SUFFIX}"


def worker(name: str) -> str:
    return f"{PREFIX}:worker:{name}"


def idempotency(key: str) -> str:
    return f"{PREFIX}:idempotency:{key}"


def worker_commands(name: str) -> str:
    return f"{PREFIX}:worker:{name}:commands"


def metric(name: str) -> str:
    return f"{PREFIX}:metrics:{name}"


# Metrics: hashes, so one HGETALL renders each; the API's /metrics reads them all.
METRIC_REQUESTS = metric("requests")  # "{METHOD} {route}|{status}" -> count (API)
METRIC_JOBS = metric("jobs")  # state -> jobs that reached it (API: queued/cancelled; workers)
METRIC_TOKENS_GENERATED = metric("tokens_generated")  # model -> count (workers, HINCRBY)
METRIC_PROMPT_TOKENS = metric("prompt_tokens")  # model -> count (workers, HINCRBY)
METRIC_TTFT = metric("ttft_seconds")  # histogram by model: protocol.histogram_fields
METRIC_BATCH_SIZE = metric("batch_size")  # histogram by model of sequences per decode step
METRIC_TOKENS_PER_SECOND = metric("tokens_per_second")  # worker name -> recent decode tok/s
METRIC_PREFIX_CACHE = metric("prefix_cache")  # "{model}|hit_tokens", "{model}|prompt_tokens"


def queue_name(model: str, kind: str = INTERACTIVE) -> str:
    """RQ queue for a model's jobs; interactive queues are served before batch queues."""
    if kind not in QUEUE_KINDS:
        raise ValueError(f"queue kind must be one of {QUEUE_KINDS}, got {kind!r}")
    return f"{PREFIX}-{model}-{kind}"


def parse_queue_name(name: str) -> tuple[str, str]:
    """(model, kind) of a queue named by `queue_name`; ValueError for any other name."""
    for kind in QUEUE_KINDS:
        head, suffix = f"{PREFIX}-", f"-{kind}"
        if name.startswith(head) and name.endswith(suffix) and len(name) > len(head + suffix):
            return name[len(head) : -len(suffix)], kind
    raise ValueError(f"not an llmq queue name (llmq-{{model}}-{{kind}}): {name!r}")
