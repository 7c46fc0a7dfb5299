"""A job's events: their types, the one codec, and the one writer of a terminal event
outside a lease.

An event is a stream entry with the fields `event` (token | done | error) and `data` (JSON).
In Python an event is a `StreamToken`, `StreamDone` or `StreamError` (named for the
stream, apart from the engine's `runtime.generator.TokenEvent`); `encode` turns one into
`Event`, the pair (kind, JSON text) that XADD and the fenced append script
(`workers.scripts.append`) take as they are, and `decode` turns a stream entry back. The
JSON below is what older readers and writers of the same stream exchange, so it does not
change with the types.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from workers import keys
from workers.wire.defaults import JOB_TTL_SECONDS
from workers.wire.job import FINISHED
from workers.wire.responses_api import response_status
from workers.wire.text import as_str, text_hash
from workers.wire.webhooks import RESPONSE_STATUS_FIELD, queue_notify

EVENT_TOKEN, EVENT_DONE, EVENT_ERROR = "token", "done", "error"

Event = tuple[str, str]  # (kind, JSON data): what XADD and `workers.scripts.append` take


# a stream entry's fields: a mapping, or the flat [name, value, ...] list Redis sends
Fields = Mapping[bytes | str, bytes | str] | list[bytes | str]


@dataclass(slots=True)  # not frozen: a frozen one took ~4 us more per token to build here
class StreamToken:
    """One generated token of one choice, as the worker appends it and readers relay it."""

    kind: ClassVar[str] = EVENT_TOKEN

    choice: int
    index: int
    text: str
    token_id: int
    logprob: float | None = None
    finish_reason: str | None = None
    attempt: int = 0
    top_logprobs: tuple[tuple[int, float], ...] = ()
    logprobs: dict[str, Any] | None = None  # the endpoint's ready-made entry, when asked
    delta: dict[str, Any] | None = None  # a chat answer parsed for tool calls

    def to_data(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "choice": self.choice,
            "index": self.index,
            "text": self.text,
            "token_id": self.token_id,
            "logprob": self.logprob,
            "top_logprobs": [list(pair) for pair in self.top_logprobs],
            "finish_reason": self.finish_reason,
            "attempt": self.attempt,
        }
        if self.logprobs is not None:
            data["logprobs"] = self.logprobs
        if self.delta is not None:
            data["delta"] = self.delta
        return data

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> StreamToken:
        """Lenient where a field is optional (a reader relays what it can); `index` and
        `token_id` are required, since a resume continues after them."""
        logprobs, delta = data.get("logprobs"), data.get("delta")
        return cls(
            choice=int(data.get("choice", 0)),
            index=int(data["index"]),
            text=data.get("text", ""),
            token_id=int(data["token_id"]),
            logprob=data.get("logprob"),
            finish_reason=data.get("finish_reason"),
            attempt=int(data.get("attempt", 0)),
            top_logprobs=tuple((int(t), lp) for t, lp in data.get("top_logprobs") or ()),
            logprobs=logprobs if isinstance(logprobs, dict) else None,
            delta=delta if isinstance(delta, dict) else None,
        )


@dataclass(frozen=True, slots=True)
class StreamDone:
    """A finished job's last event: exactly the body the synchronous call returns."""

    kind: ClassVar[str] = EVENT_DONE

    result: dict[str, Any]

    def to_data(self) -> dict[str, Any]:
        return self.result

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> StreamDone:
        return cls(dict(data))


@dataclass(frozen=True, slots=True)
class StreamError:
    """A failed or cancelled job's last event: the OpenAI error object and the HTTP status
    the API answers a waiting client with (`workers.wire.errors.error_body`)."""

    kind: ClassVar[str] = EVENT_ERROR

    error: dict[str, Any] | None  # None only when a writer left it out
    status: int = 500

    def to_data(self) -> dict[str, Any]:
        return {"error": self.error, "status": self.status}

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> StreamError:
        status = data.get("status")
        if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599:
            status = 500
        error = data.get("error")
        return cls(error if isinstance(error, dict) else None, status)


@dataclass(frozen=True, slots=True)
class StreamOther:
    """An event of a kind this version does not know (a newer writer's): readers skip it."""

    kind: str
    data: dict[str, Any]

    def to_data(self) -> dict[str, Any]:
        return self.data


StreamEvent = StreamToken | StreamDone | StreamError | StreamOther
_TYPES: dict[str, Any] = {
    EVENT_TOKEN: StreamToken,
    EVENT_DONE: StreamDone,
    EVENT_ERROR: StreamError,
}


def encode(event: StreamEvent) -> Event:
    """The one encoder: a job event as the (kind, JSON) pair a stream entry holds."""
    return event.kind, json.dumps(event.to_data(), ensure_ascii=False)


def decode(fields: Fields) -> StreamEvent:
    """The one decoder: a stream entry (XRANGE/XREAD fields) as its typed event."""
    kind, data = decode_event(fields)
    event_type = _TYPES.get(kind)
    return StreamOther(kind, data) if event_type is None else event_type.from_data(data)


def is_terminal(event: StreamEvent) -> bool:
    return isinstance(event, StreamDone | StreamError)


def encode_event(kind: str, data: Mapping[str, Any]) -> Event:
    """`encode` for a kind and data given apart (the error and done bodies the worker holds)."""
    return kind, json.dumps(data, ensure_ascii=False)


def event_fields(event: Event) -> dict[str, str]:
    """Stream entry fields for XADD."""
    kind, data = event
    return {"event": kind, "data": data}


def decode_event(fields: Fields) -> tuple[str, dict[str, Any]]:
    """A stream entry as (kind, its JSON object), unchecked: what `decode` types, and what
    tests and tools that look at a stream's raw entries read. `fields` as redis-py's
    callbacks give them (a mapping), or as Redis sent them (a flat [name, value, ...] list:
    api/stream_hub.py's XREAD)."""
    pairs = zip(fields[::2], fields[1::2], strict=True) if isinstance(fields, list) else None
    h = text_hash(fields) if pairs is None else {as_str(k): as_str(v) for k, v in pairs}
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
    top_logprobs: Sequence[tuple[int, float]] | None = None,
    delta: dict[str, Any] | None = None,
) -> Event:
    """A `StreamToken`, encoded (the arguments in the order the worker has them)."""
    event = StreamToken(
        choice=choice,
        index=index,
        text=text,
        token_id=token_id,
        logprob=logprob,
        finish_reason=finish_reason,
        attempt=attempt,
        top_logprobs=tuple(top_logprobs) if top_logprobs else (),
        logprobs=logprobs,
        delta=delta,
    )
    return encode(event)


def ending(status: str, body: dict[str, Any]) -> tuple[dict[str, str], Event]:
    """The record fields and the terminal event of a job that ends with `status`: `body` is
    the result of a finished job, else the error body of a failed or cancelled one. The
    fields carry the response's final status (`RESPONSE_STATUS_FIELD`), which the write
    that ends the job copies into a notifying job's outbox entry (`wire.webhooks`)."""
    final = response_status(status, body if status == FINISHED else None)
    fields = {"status": status, "finished_at": str(time.time()), RESPONSE_STATUS_FIELD: final}
    if status == FINISHED:
        fields["result"] = json.dumps(body, ensure_ascii=False)
        return fields, encode(StreamDone(body))
    event = StreamError.from_data(body)
    fields["error"] = json.dumps(event.to_data())
    return fields, encode(event)


def write_ending(
    pipe: Any, job_id: str, status: str, body: dict[str, Any], events: Any = None
) -> None:
    """Queue on `pipe` the end of a job nobody holds a lease on (cancelled while queued, or
    refused): record fields, terminal event, its count in `METRIC_JOBS` and, for a record
    marked as notifying, its webhook outbox entry (`wire.webhooks`). A job a worker
    runs ends through the fenced `scripts.append` with the same `ending`. With `events` (the
    events cluster's client, `wire.broker.EventsSettings`) the terminal event is written
    there now, before the record's end that `pipe` carries (the stream ends first)."""
    fields, event = ending(status, body)
    pipe.hset(keys.job(job_id), mapping=fields)
    stream = pipe if events is None else events.pipeline(transaction=False)
    stream.xadd(keys.job_events(job_id), event_fields(event))
    stream.expire(keys.job_events(job_id), JOB_TTL_SECONDS)
    if stream is not pipe:
        stream.execute()
    pipe.hincrby(keys.METRIC_JOBS, status, 1)
    queue_notify(pipe, job_id, status)
