"""What crosses Redis between the API and the workers: job records and job events (JSON).

Shared by `api/` and `workers/`; imports only the standard library. Nothing here is ever
pickled: a job record is a Redis hash of strings, an event is a stream entry with the
fields `event` (token | done | error) and `data` (JSON).

Token event data: `{"choice": c, "index": i, "text": "...", "token_id": t, "logprob": lp,
"top_logprobs": [[id, lp], ...], "finish_reason": null | "stop" | "length"}` where `index`
counts the generated tokens of choice `c` from 0. A job with several choices (`n`, or a
list of prompts) interleaves their tokens. `done` data is exactly the body the synchronous
call returns; `error` data is an OpenAI error body `{"error": {...}}` plus `"status"`.
"""

from __future__ import annotations

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
        )


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
