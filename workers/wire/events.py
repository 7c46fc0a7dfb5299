"""A job's events: the one codec, and the one writer of a terminal event outside a lease.

An event is a stream entry with the fields `event` (token | done | error) and `data` (JSON).
In Python it travels as `Event`, the pair (kind, JSON text) that XADD and the fenced append
script (`workers.scripts.append`) take as they are.

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
the legacy layout); `top_logprobs` ids are then filled too, else `[]`. A chat job whose
answer may hold tool calls adds `"delta"`: what this token shows the client, `{"content":
"..."}` and/or `{"tool_calls": [...]}` in OpenAI's stream-delta shape (`runtime.tool_calls`
splits the text; text that may start a call is held back, so a delta can be empty and a
later one carry several tokens' text); `text` stays the raw token text. `done` data is
exactly the body the synchronous call returns; `error` data is an OpenAI error body
`{"error": {...}}` plus `"status"` (`workers.wire.errors.error_body`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from workers import keys
from workers.wire.defaults import JOB_TTL_SECONDS
from workers.wire.job import FINISHED
from workers.wire.text import text_hash

EVENT_TOKEN, EVENT_DONE, EVENT_ERROR = "token", "done", "error"

Event = tuple[str, str]  # (kind, JSON data)


def encode_event(kind: str, data: Mapping[str, Any]) -> Event:
    return kind, json.dumps(data, ensure_ascii=False)


def event_fields(event: Event) -> dict[str, str]:
    """Stream entry fields for XADD."""
    kind, data = event
    return {"event": kind, "data": data}


def decode_event(fields: Mapping[bytes | str, bytes | str]) -> tuple[str, dict[str, Any]]:
    h = text_hash(fields)
    return h["event"], json.loads(h["data"])


def token_event(
    choice: int,
    index: int,
    text: str,
    token_id: int,
    logprob: float | None,
    finish_reason: str | None,
    attempt: int,
    logprobs: dict[str, Any] | None = None,
    top_logprobs: list[tuple[int, float]] | None = None,
    delta: dict[str, Any] | None = None,
) -> Event:
    data: dict[str, Any] = {
        "choice": choice,
        "index": index,
        "text": text,
        "token_id": token_id,
        "logprob": logprob,
        "top_logprobs": [list(pair) for pair in top_logprobs or []],
        "finish_reason": finish_reason,
        "attempt": attempt,
    }
    if logprobs is not None:
        data["logprobs"] = logprobs
    if delta is not None:
        data["delta"] = delta
    return encode_event(EVENT_TOKEN, data)


def ending(status: str, body: dict[str, Any]) -> tuple[dict[str, str], Event]:
    """The record fields and the terminal event of a job that ends with `status`: `body` is
    the result of a finished job, else the error body of a failed or cancelled one."""
    fields = {"status": status, "finished_at": str(time.time())}
    if status == FINISHED:
        fields["result"] = json.dumps(body, ensure_ascii=False)
        return fields, encode_event(EVENT_DONE, body)
    fields["error"] = json.dumps(body)
    return fields, encode_event(EVENT_ERROR, body)


def write_ending(pipe: Any, job_id: str, status: str, body: dict[str, Any]) -> None:
    """Queue on `pipe` the end of a job nobody holds a lease on (cancelled while queued, or
    refused): record fields, terminal event, and its count in `METRIC_JOBS`. A job a worker
    runs ends through the fenced `scripts.append` with the same `ending`."""
    fields, event = ending(status, body)
    pipe.hset(keys.job(job_id), mapping=fields)
    pipe.xadd(keys.job_events(job_id), event_fields(event))
    pipe.expire(keys.job_events(job_id), JOB_TTL_SECONDS)
    pipe.hincrby(keys.METRIC_JOBS, status, 1)
