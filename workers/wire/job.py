"""A job: its statuses, the endpoints it serves, and its record in `keys.job(id)`.

Lifecycle (record `status`, and the RQ job's status alongside): `queued` -> `started`
(a worker claimed it: `attempts` + 1, `worker`, `started_at` on the first start) ->
`finished` (`result`, `completion_tokens`, `finished_at`; `done` event) or `failed`
(`error`, `finished_at`; `error` event) or `cancelled` (`error` = `cancelled_error()`,
`finished_at`; `error` event with that body). A job whose worker died or shut down is
put back to `queued` at the front of its queue (RQ status too) and resumed by the next
worker from its stream. While a job runs, `completion_tokens` counts the tokens streamed.
A job is started at most `defaults.MAX_ATTEMPTS` times: one whose workers keep dying with
it is then failed with a 500 instead of being retried forever.

Cancelling: set `keys.job_cancel(id)` (any value, TTL `CANCEL_FLAG_TTL_SECONDS`) first.
Then, if LREM of the id from its RQ queue returns 1, nobody will run it and the API marks
it cancelled itself (record, RQ `job.cancel()`, the `error` event); otherwise a worker
has it or is taking it: a worker checks the flag when it claims a job (a flagged job never
runs) and after every decode step, and ends the job as above within a step or two.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields
from typing import Any

from workers.wire.text import optional_float, text_hash

QUEUED, STARTED, FINISHED, FAILED, CANCELLED = (
    "queued",
    "started",
    "finished",
    "failed",
    "cancelled",
)
JOB_STATUSES = (QUEUED, STARTED, FINISHED, FAILED, CANCELLED)
TERMINAL_STATUSES = frozenset({FINISHED, FAILED, CANCELLED})

COMPLETIONS, CHAT_COMPLETIONS, EMBEDDINGS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
)
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS, EMBEDDINGS)
# A batch may also hold Responses API requests: each line runs as a chat job whose record
# carries the Responses request (`JobRecord.responses`), answered as a Response object.
RESPONSES = "/v1/responses"
BATCH_ENDPOINTS = (*ENDPOINTS, RESPONSES)

# The only function a worker runs; anything else found on a queue is refused (docs/faults.md F19).
JOB_FUNCTION = "workers.jobs.run_job"


@dataclass
class JobRecord:
    """A job as stored in `keys.job(id)`; `request` is the validated request body and
    `spec` what the worker generates from it (`runtime.request.GenerationSpec.to_record`,
    made by the API's schemas; None for embeddings, which read `request`)."""

    id: str
    endpoint: str
    model: str
    request: dict[str, Any]
    kind: str = "interactive"  # keys.INTERACTIVE or keys.BATCH
    priority: int = 0  # lower is taken, admitted and kept sooner (`keys.level_queue_name`)
    status: str = QUEUED
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    attempts: int = 0
    worker: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    preemptions: int = 0  # times its last run lost its KV memory to higher priorities
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    batch_id: str | None = None  # set for the requests of an offline batch
    queue: str | None = None  # a worker's own queue the API routed it to (prefix affinity)
    owner: str | None = None  # digest of the API key that created it (`api.auth.owner_of`)
    spec: dict[str, Any] | None = None
    # the `model` its responses name when not `model`: the LoRA adapter a request named as
    # its model (vLLM's convention), while `model` is the base model that runs it
    response_model: str | None = None
    # tokens reserved in a caller's rate-limit bucket, until the job's end settles them
    # (`workers.wire.rate_limit.Reservation`; the settling script deletes these fields)
    ratelimit_key: str | None = None
    ratelimit_tokens: int | None = None
    ratelimit_token_ms: float | None = None
    # a Responses API response (`workers.wire.responses_api`): its request as the client
    # gave it (normalised, input items with ids) beside the chat request it runs as
    responses: dict[str, Any] | None = None

    @property
    def responds_as(self) -> str:
        """The `model` of its response body, stream chunks and job object."""
        return self.response_model or self.model

    def to_hash(self) -> dict[str, str]:
        """Every field as a string (JSON for structured values); None fields are omitted."""
        out = {}
        for name in _RECORD_FIELDS:  # not `asdict`: it deep-copies the request and spec
            value = getattr(self, name)
            if value is None:
                continue
            out[name] = json.dumps(value) if isinstance(value, dict) else str(value)
        return out

    @classmethod
    def from_hash(cls, raw: dict[bytes | str, bytes | str]) -> JobRecord:
        h = text_hash(raw)
        return cls(
            id=h["id"],
            endpoint=h["endpoint"],
            model=h["model"],
            request=json.loads(h["request"]),
            kind=h.get("kind", "interactive"),
            priority=int(h.get("priority", 0)),
            status=h.get("status", QUEUED),
            created_at=float(h["created_at"]),
            started_at=optional_float(h.get("started_at")),
            finished_at=optional_float(h.get("finished_at")),
            attempts=int(h.get("attempts", 0)),
            worker=h.get("worker"),
            prompt_tokens=int(h.get("prompt_tokens", 0)),
            completion_tokens=int(h.get("completion_tokens", 0)),
            preemptions=int(h.get("preemptions", 0)),
            result=json.loads(h["result"]) if "result" in h else None,
            error=json.loads(h["error"]) if "error" in h else None,
            batch_id=h.get("batch_id"),
            queue=h.get("queue"),
            owner=h.get("owner"),
            spec=json.loads(h["spec"]) if "spec" in h else None,
            response_model=h.get("response_model"),
            ratelimit_key=h.get("ratelimit_key"),
            ratelimit_tokens=int(h["ratelimit_tokens"]) if "ratelimit_tokens" in h else None,
            ratelimit_token_ms=optional_float(h.get("ratelimit_token_ms")),
            responses=json.loads(h["responses"]) if "responses" in h else None,
        )


_RECORD_FIELDS = tuple(f.name for f in fields(JobRecord))


def response_id(endpoint: str, job_id: str) -> str:
    """The `id` of a job's response body and of its stream chunks (the same for both)."""
    prefix = {CHAT_COMPLETIONS: "chatcmpl", COMPLETIONS: "cmpl"}.get(endpoint, "embd")
    return f"{prefix}-{job_id}"
