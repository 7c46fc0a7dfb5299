"""What crosses Redis between the API and the workers: job records and job events (JSON).

Shared by `api/` and `workers/`; imports only the standard library. Nothing here is ever
pickled: a job record is a Redis hash of strings, an event is a stream entry with the
fields `event` (token | done | error) and `data` (JSON).

Token event data: `{"choice": c, "index": i, "text": "...", "token_id": t, "logprob": lp (null
unless the request asked for logprobs),
"top_logprobs": [[id, lp], ...], "finish_reason": null | "stop" | "length", "attempt": a}`
where `index` counts the generated tokens of choice `c` from 0. A job with several choices
(`n`, or a list of prompts) interleaves their tokens. `attempt` is the execution that wrote
the event (a resumed job continues the same indexes under a higher attempt). When the
request asked for logprobs, the event also has `"logprobs"`: this token's entry already in
the endpoint's layout, ready for a stream chunk: for chat `{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...]}` (one item of `logprobs.content`), for
completions `{"token", "logprob", "top_logprobs": {text: lp}, "text_offset"}` (one column of
the legacy layout); `top_logprobs` ids are then filled too, else `[]`. `done` data is
exactly the body the synchronous call returns; `error` data is an OpenAI error body
`{"error": {...}}` plus `"status"`.

Job lifecycle (record `status`, and the RQ job's status alongside): `queued` -> `started`
(a worker claimed it: `attempts` + 1, `worker`, `started_at` on the first start) ->
`finished` (`result`, `completion_tokens`, `finished_at`; `done` event) or `failed`
(`error`, `finished_at`; `error` event) or `cancelled` (`error` = `cancelled_error()`,
`finished_at`; `error` event with that body). A job whose worker died or shut down is
put back to `queued` at the front of its queue (RQ status too) and resumed by the next
worker from its stream. While a job runs, `completion_tokens` counts the tokens streamed.

Cancelling: set `keys.job_cancel(id)` (any value, TTL `CANCEL_FLAG_TTL_SECONDS`) first.
Then, if LREM of the id from its RQ queue returns 1, nobody will run it and the API marks
it cancelled itself (record, RQ `job.cancel()`, the `error` event); otherwise a worker
has it or is taking it: a worker checks the flag when it claims a job (a flagged job never
runs) and after every decode step, and ends the job as above within a step or two.

`keys.MODELS` values: JSON `{"id", "source", "owned_by": "llmq"}`, plus `"context_length"`
once a worker has loaded the model; written by every worker on each heartbeat (the
registry's models plus any .gguf path a worker serves, under the file's stem).

A job is started at most 5 times (`attempts`): one whose workers keep dying with it is
then failed with a 500 instead of being retried forever.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

QUEUED, STARTED, FINISHED, FAILED, CANCELLED = (
    "queued",
    "started",
    "finished",
    "failed",
    "cancelled",
)
TERMINAL_STATUSES = frozenset({FINISHED, FAILED, CANCELLED})

EVENT_TOKEN, EVENT_DONE, EVENT_ERROR = "token", "done", "error"

COMPLETIONS, CHAT_COMPLETIONS, EMBEDDINGS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
)
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS, EMBEDDINGS)

# The only function a worker runs; anything else found on a queue is refused (RELIABILITY F19).
JOB_FUNCTION = "workers.jobs.run_job"

JOB_TTL_SECONDS = 24 * 3600  # job record and event stream, which hold prompt and output text
LEASE_TTL_SECONDS = 10  # a running job's lease; renewed every LEASE_RENEW_SECONDS
LEASE_RENEW_SECONDS = 2
WORKER_HEARTBEAT_SECONDS = 5  # a worker rewrites its hash this often ...
WORKER_TTL_SECONDS = 15  # ... with this TTL; a missing or stale hash means a dead worker
CANCEL_FLAG_TTL_SECONDS = 3600  # keys.job_cancel lives this long once set
AFFINITY_TTL_SECONDS = 600  # a keys.affinity entry; a worker's prefix cache may evict sooner
WAKE_MAX_TOKENS = 4  # a queue's wake list keeps this many; more would only wake idle workers
WAKE_TTL_SECONDS = 30  # ... for nothing, and a list nobody pops (its worker died) vanishes
AFFINITY_MAX_QUEUED = 4  # jobs waiting in one worker's own queue before the rest go shared
PREFIX_DIGEST_CHARS = 1000  # of a prompt's head that another prompt may share ...
PREFIX_DIGEST_MIN_CHARS = 200  # ... and below which routing for a cache hit does not pay

# Histogram buckets shared by workers (which write) and the API (which renders /metrics).
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class JobRecord:
    """A job as stored in `keys.job(id)`; `request` is the validated request body."""

    id: str
    endpoint: str
    model: str
    request: dict[str, Any]
    kind: str = "interactive"  # keys.INTERACTIVE or keys.BATCH
    status: str = QUEUED
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int = 0
    worker: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    batch_id: str | None = None  # set for the requests of an offline batch
    queue: str | None = None  # a worker's own queue the API routed it to (prefix affinity)
    owner: str | None = None  # digest of the API key that created it (`api.auth.owner_of`)

    def to_hash(self) -> dict[str, str]:
        """Every field as a string (JSON for structured values); None fields are omitted."""
        out = {}
        for name, value in asdict(self).items():
            if value is None:
                continue
            out[name] = json.dumps(value) if isinstance(value, dict) else str(value)
        return out

    @classmethod
    def from_hash(cls, raw: dict[bytes | str, bytes | str]) -> JobRecord:
        h = {_text(k): _text(v) for k, v in raw.items()}
        return cls(
            id=h["id"],
            endpoint=h["endpoint"],
            model=h["model"],
            request=json.loads(h["request"]),
            kind=h.get("kind", "interactive"),
            status=h.get("status", QUEUED),
            created_at=float(h["created_at"]),
            started_at=_float(h.get("started_at")),
            finished_at=_float(h.get("finished_at")),
            attempts=int(h.get("attempts", 0)),
            worker=h.get("worker"),
            prompt_tokens=int(h.get("prompt_tokens", 0)),
            completion_tokens=int(h.get("completion_tokens", 0)),
            result=json.loads(h["result"]) if "result" in h else None,
            error=json.loads(h["error"]) if "error" in h else None,
            batch_id=h.get("batch_id"),
            queue=h.get("queue"),
            owner=h.get("owner"),
        )


def response_id(endpoint: str, job_id: str) -> str:
    """The `id` of a job's response body and of its stream chunks (the same for both)."""
    prefix = {CHAT_COMPLETIONS: "chatcmpl", COMPLETIONS: "cmpl"}.get(endpoint, "embd")
    return f"{prefix}-{job_id}"


def prefix_digest(endpoint: str, request: dict[str, Any]) -> str | None:
    """A short hash of the part of a request that later requests are likely to share, so
    the API can send them to the worker whose prefix cache holds it (`workers.affinity`).

    Chat: the messages before the last user message (system prompt and history), or the
    head of the first message when nothing comes before it. Completions: the head of the
    prompt. None where routing would not pay: embeddings, lists of prompts, short prefixes.
    """
    if endpoint == CHAT_COMPLETIONS:
        material = _chat_prefix(request.get("messages"))
    elif endpoint == COMPLETIONS and isinstance(request.get("prompt"), str):
        material = [["prompt", request["prompt"][:PREFIX_DIGEST_CHARS], None]]
    else:
        return None
    if material is None or sum(len(text) for _, text, _ in material) < PREFIX_DIGEST_MIN_CHARS:
        return None
    # ensure_ascii (the default) keeps lone surrogates, which JSON bodies may carry, hashable
    canonical = json.dumps([endpoint, material], separators=(",", ":"))
    return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def continuation_digest(endpoint: str, request: dict[str, Any], reply: str) -> str | None:
    """The `prefix_digest` of this conversation's next turn, if the client sends `reply` back
    as the assistant message (the worker's prefix cache then holds that whole history)."""
    if endpoint != CHAT_COMPLETIONS or not isinstance(request.get("messages"), list):
        return None
    turn = [{"role": "assistant", "content": reply}, {"role": "user", "content": ""}]
    return prefix_digest(endpoint, {"messages": [*request["messages"], *turn]})


def _chat_prefix(messages: Any) -> list[list[Any]] | None:
    """[role, content, name] of the messages before the last user message."""
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) for m in messages)
    ):
        return None
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    last = users[-1] if users else len(messages) - 1
    shared = messages[:last] or [messages[0]]
    out = [[m.get("role"), str(m.get("content") or ""), m.get("name")] for m in shared]
    if not messages[:last]:
        out[0][1] = out[0][1][:PREFIX_DIGEST_CHARS]
    return out


def cancelled_error() -> dict[str, Any]:
    """The `error` event data (and record `error`) of a cancelled job."""
    return error_body("The job was cancelled.", code="cancelled", status=409)


@dataclass
class WorkerInfo:
    """A worker as stored in `keys.worker(name)` (and its name in `keys.WORKERS`).

    `pool` maps model id -> {"state": "loading" | "ready" | "failed", "memory_mb": float,
    "in_flight": int, "error": str | None}; `models` are the models it serves (ready or
    loadable), `queues` the RQ queues it takes jobs from, `current_jobs` the job ids it runs.
    """

    name: str
    pid: int = 0
    host: str = ""
    state: str = "idle"  # idle | busy | stopping
    models: list[str] = field(default_factory=list)
    queues: list[str] = field(default_factory=list)
    current_jobs: list[str] = field(default_factory=list)
    pool: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    heartbeat: float = field(default_factory=time.time)
    max_batch: int = 0  # sequences it steps together (0: not published)

    def to_hash(self) -> dict[str, str]:
        return {
            name: json.dumps(value) if isinstance(value, list | dict) else str(value)
            for name, value in asdict(self).items()
        }

    @classmethod
    def from_hash(cls, raw: dict[bytes | str, bytes | str]) -> WorkerInfo:
        h = {_text(k): _text(v) for k, v in raw.items()}
        return cls(
            name=h["name"],
            pid=int(h.get("pid", 0)),
            host=h.get("host", ""),
            state=h.get("state", "idle"),
            models=json.loads(h.get("models", "[]")),
            queues=json.loads(h.get("queues", "[]")),
            current_jobs=json.loads(h.get("current_jobs", "[]")),
            pool=json.loads(h.get("pool", "{}")),
            started_at=float(h.get("started_at", 0)),
            heartbeat=float(h.get("heartbeat", 0)),
            max_batch=int(h.get("max_batch", 0)),
        )

    def is_alive(self, now: float | None = None) -> bool:
        return (now if now is not None else time.time()) - self.heartbeat <= WORKER_TTL_SECONDS

    def takes_own_queue(self, queue: str, now: float | None = None) -> bool:
        """Whether jobs in its own `queue` will be run by it: alive, not draining, serving it."""
        return self.is_alive(now) and self.state != "stopping" and queue in self.queues


COMMAND_LOAD, COMMAND_UNLOAD = "load", "unload"


def encode_command(op: str, model: str) -> str:
    """An admin command for `keys.worker_commands(name)`: JSON `{"op", "model"}`.

    `load` starts loading the model into that worker's pool (evicting an idle model if the
    pool is full); `unload` drops it now, or as soon as its last sequence ends. The outcome
    shows in the worker's `WorkerInfo.pool` within a heartbeat (loading -> ready | failed).
    """
    if op not in (COMMAND_LOAD, COMMAND_UNLOAD):
        raise ValueError(f"op must be {COMMAND_LOAD!r} or {COMMAND_UNLOAD!r}, got {op!r}")
    return json.dumps({"op": op, "model": model})


def decode_command(raw: bytes | str) -> tuple[str, str]:
    """(op, model) of an admin command; ValueError if it is not one."""
    try:
        data = json.loads(_text(raw))
        op, model = data["op"], data["model"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"not an admin command: {_text(raw)[:80]!r}") from exc
    if op not in (COMMAND_LOAD, COMMAND_UNLOAD) or not isinstance(model, str):
        raise ValueError(f"not an admin command: {_text(raw)[:80]!r}")
    return op, model


WAKE_TOKEN = "1"


def push_wake(pipe: Any, wake_key: str) -> None:
    """Queue on `pipe` a wake token for `keys.queue_wake(queue)`, right after putting a job
    on that queue (in the same transaction, so a worker woken by the token finds the job).

    An idle worker blocks on the wake lists of its queues (`workers.presence`) and claims
    at once when one is pushed, instead of at the end of its poll interval. Tokens carry no
    data: a worker that finds the queue empty (someone else took the job) just waits again.
    """
    pipe.lpush(wake_key, WAKE_TOKEN)
    pipe.ltrim(wake_key, 0, WAKE_MAX_TOKENS - 1)
    pipe.expire(wake_key, WAKE_TTL_SECONDS)


def format_bucket(bound: float) -> str:
    return f"{bound:g}"


def histogram_fields(label: str, value: float, buckets: tuple[float, ...]) -> tuple[str, str, str]:
    """Hash fields for one observation of a histogram kept in a Redis hash.

    HINCRBY the first (the bucket `value` falls in, not cumulative) and the second
    (`count`) by 1, and HINCRBYFLOAT the third (`sum`) by `value`; `label` is the model id.
    """
    bound = next((format_bucket(b) for b in buckets if value <= b), "+Inf")
    return f"{label}|{bound}", f"{label}|count", f"{label}|sum"


def encode_event(kind: str, data: dict[str, Any]) -> dict[str, str]:
    """Stream entry fields for XADD."""
    return {"event": kind, "data": json.dumps(data, ensure_ascii=False)}


def decode_event(fields: dict[bytes | str, bytes | str]) -> tuple[str, dict[str, Any]]:
    h = {_text(k): _text(v) for k, v in fields.items()}
    return h["event"], json.loads(h["data"])


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    status: int = 400,
) -> dict[str, Any]:
    """OpenAI's error shape, plus the HTTP status the API should answer with."""
    return {
        "error": {"message": message, "type": type_, "param": param, "code": code},
        "status": status,
    }


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _float(value: str | None) -> float | None:
    return None if value is None else float(value)


# ---------------------------------------------------------------- offline batches
#
# A batch (OpenAI's Batch API) is validated by the API when it is created: each valid line
# of its input file is stored under `keys.batch_requests`, each invalid one goes straight
# to `keys.batch_errors`. From then on the batch driver (`workers.batches`, run by any
# worker under `keys.BATCHES_LOCK`) moves it on: validating -> in_progress (lines fed as
# jobs of kind `batch`, a bounded number queued at a time) -> finalizing -> completed; or
# cancelling -> cancelled, or expired once `expires_at` passes. Every valid line ends in
# exactly one of `keys.batch_output` / `keys.batch_errors`, keyed by its line number.

BATCH_VALIDATING, BATCH_IN_PROGRESS, BATCH_FINALIZING = "validating", "in_progress", "finalizing"
BATCH_COMPLETED, BATCH_FAILED, BATCH_EXPIRED = "completed", "failed", "expired"
BATCH_CANCELLING, BATCH_CANCELLED = "cancelling", "cancelled"
BATCH_TERMINAL = frozenset({BATCH_COMPLETED, BATCH_FAILED, BATCH_EXPIRED, BATCH_CANCELLED})

FILE_PURPOSE_BATCH, FILE_PURPOSE_OUTPUT = "batch", "batch_output"
MAX_FILE_BYTES = 100 * 1024 * 1024  # one upload; Redis keeps it in memory, so not OpenAI's 200 MB
MAX_BATCH_LINES = 50_000  # requests in one input file (OpenAI's limit)
MAX_LINE_BYTES = 1024 * 1024  # one request line: the live API's body limit
FILE_TTL_SECONDS = 3 * 24 * 3600  # files hold prompt or output text: kept 3 days at most
MAX_COMPLETION_WINDOW_SECONDS = 24 * 3600


@dataclass
class FileRecord:
    """A file as stored in `keys.file(id)` (its bytes are in `keys.file_content(id)`)."""

    id: str
    bytes: int
    filename: str
    purpose: str
    created_at: float = field(default_factory=time.time)
    expires_at: float | None = None
    owner: str | None = None  # digest of the API key that created it (or its batch)

    def to_hash(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_hash(cls, raw: dict[bytes | str, bytes | str]) -> FileRecord:
        h = {_text(k): _text(v) for k, v in raw.items()}
        return cls(
            id=h["id"],
            bytes=int(h["bytes"]),
            filename=h.get("filename", ""),
            purpose=h["purpose"],
            created_at=float(h["created_at"]),
            expires_at=_float(h.get("expires_at")),
            owner=h.get("owner"),
        )

    def to_object(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": int(self.created_at),
            "expires_at": None if self.expires_at is None else int(self.expires_at),
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


_BATCH_TIMES = (
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
)
_BATCH_COUNTS = ("total", "completed", "failed", "valid", "fed")
_BATCH_TOKENS = ("input_tokens", "cached_tokens", "output_tokens")


@dataclass
class BatchRecord:
    """A batch as stored in `keys.batch(id)`. `valid` lines run as jobs; `fed` of them
    (in `keys.batch_lines` order) have been enqueued. `completed` / `failed` and the token
    counts are incremented in Redis as lines are collected. `ending` is "expired" once
    the driver is winding an overdue batch down."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    expires_at: float
    created_at: float = field(default_factory=time.time)
    status: str = BATCH_VALIDATING
    model: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    valid: int = 0
    fed: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None
    ending: str | None = None
    owner: str | None = None  # digest of the API key that created it; its jobs and files inherit it

    def to_hash(self) -> dict[str, str]:
        out = {}
        for name, value in asdict(self).items():
            if value is None:
                continue
            out[name] = json.dumps(value) if isinstance(value, dict | list) else str(value)
        return out

    @classmethod
    def from_hash(cls, raw: dict[bytes | str, bytes | str]) -> BatchRecord:
        h = {_text(k): _text(v) for k, v in raw.items()}
        record = cls(
            id=h["id"],
            endpoint=h["endpoint"],
            input_file_id=h["input_file_id"],
            completion_window=h["completion_window"],
            expires_at=float(h["expires_at"]),
            created_at=float(h["created_at"]),
            status=h.get("status", BATCH_VALIDATING),
            model=h.get("model"),
            output_file_id=h.get("output_file_id"),
            error_file_id=h.get("error_file_id"),
            metadata=json.loads(h["metadata"]) if "metadata" in h else None,
            errors=json.loads(h["errors"]) if "errors" in h else None,
            ending=h.get("ending"),
            owner=h.get("owner"),
        )
        for name in _BATCH_TIMES:
            setattr(record, name, _float(h.get(name)))
        for name in _BATCH_COUNTS + _BATCH_TOKENS:
            setattr(record, name, int(h.get(name, 0)))
        return record

    def to_object(self) -> dict[str, Any]:
        """OpenAI's batch object."""
        obj: dict[str, Any] = {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model,
            "errors": {"object": "list", "data": self.errors} if self.errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": int(self.created_at),
            "in_progress_at": _int(self.in_progress_at),
            "expires_at": _int(self.expires_at),
            "finalizing_at": _int(self.finalizing_at),
            "completed_at": _int(self.completed_at),
            "failed_at": _int(self.failed_at),
            "expired_at": _int(self.expired_at),
            "cancelling_at": _int(self.cancelling_at),
            "cancelled_at": _int(self.cancelled_at),
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "usage": {
                "input_tokens": self.input_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.input_tokens + self.output_tokens,
            },
            "metadata": self.metadata,
        }
        return obj


def batch_request_id(batch_id: str, line: int) -> str:
    """The `id` of a line's record in the output or error file (stable across retries)."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


def output_line(batch_id: str, line: int, custom_id: str, job_id: str, body: dict[str, Any]) -> str:
    """One line of a batch's output file: the body the live endpoint would have returned."""
    response = {"status_code": 200, "request_id": job_id, "body": body}
    return _line(batch_id, line, custom_id, response, None)


def error_line(
    batch_id: str,
    line: int,
    custom_id: str | None,
    code: str,
    message: str,
    response: dict[str, Any] | None = None,
) -> str:
    """One line of a batch's error file; `response` is set for a request that ran and
    failed (`{"status_code", "request_id", "body": {"error": ...}}`), else None."""
    return _line(batch_id, line, custom_id, response, {"code": code, "message": message})


def _line(
    batch_id: str,
    line: int,
    custom_id: str | None,
    response: dict[str, Any] | None,
    error: dict[str, Any] | None,
) -> str:
    record = {
        "id": batch_request_id(batch_id, line),
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }
    return json.dumps(record, ensure_ascii=False)


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)
