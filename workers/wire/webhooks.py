"""Webhooks: which jobs notify, the events their ends become, the outbox, the endpoints.

A job notifies when its record carries `NOTIFY_FIELD` (set at submission: merge
`notify_fields()` into the record's hash; the Responses API does so for every response).
The write that ends such a job (`workers.scripts` final paths, `cluster_step._RECORD_STEP`,
`wire.events.write_ending`) also appends an outbox entry `{kind, id, status,
response_status}` to `keys.WEBHOOK_OUTBOX` in the same script or transaction, so the event
is in Redis before anyone is told, and a process killed after the write loses nothing. The
response's final status comes with it: `wire.events.ending` puts it among the record fields
that write sets (`RESPONSE_STATUS_FIELD`, derived by `responses_api.response_status`, the
one derivation) and the script copies it into the entry, so the dispatcher reads no record.
A job without the notify field costs that final write one HMGET, nothing per step. A
batch's terminal write appends its entry the same way (`queue_batch_event`), always:
batches are few.

The dispatcher (workers/webhooks/dispatcher.py) turns an entry into an event with
`response_event_type` or `batch_event_type` and `event_body` (ids are a function of the
event, so a re-dispatch names the same event) and enqueues one delivery per endpoint
subscribed to its type. Endpoints are JSON in the hash `keys.WEBHOOKS`; each one's last
deliveries are a capped list (`log_delivery`).
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from workers import keys
from workers.wire.responses_api import response_status
from workers.wire.text import as_str

NOTIFY_FIELD = "notify"  # a job record field: its value is the outbox entry's `kind`
# a job record field the terminal write sets (`wire.events.ending`), copied into the entry
RESPONSE_STATUS_FIELD = "response_status"
NOTIFY_RESPONSE = "response"
NOTIFY_BATCH = "batch"

RESPONSE_COMPLETED, RESPONSE_FAILED = "response.completed", "response.failed"
RESPONSE_CANCELLED, RESPONSE_INCOMPLETE = "response.cancelled", "response.incomplete"
RESPONSE_EVENTS = (RESPONSE_COMPLETED, RESPONSE_FAILED, RESPONSE_CANCELLED, RESPONSE_INCOMPLETE)
BATCH_EVENTS = ("batch.completed", "batch.failed", "batch.cancelled", "batch.expired")
EVENT_TYPES = RESPONSE_EVENTS + BATCH_EVENTS

SECRET_PREFIX = "whsec_"
ENDPOINT_ID_PREFIX = "we_"
DELIVERY_LOG_LENGTH = 100  # per endpoint
MAX_URL_LENGTH = 2048


def notify_fields(kind: str = NOTIFY_RESPONSE) -> dict[str, str]:
    """The record fields that make a job's end notify the webhooks (merge them into the
    record's hash when it is created)."""
    return {NOTIFY_FIELD: kind}


def response_event_type(
    status: str, result: Mapping[str, Any] | None, final_status: str = ""
) -> str | None:
    """The event a notifying job's end is: `response.<status>` of the response's final
    status, `final_status` where the outbox entry carries it, else derived from the job's
    status and result (`responses_api.response_status`: `finished` is `incomplete` when its
    result says the token limit cut it, else `completed`); a status that is not an end, or
    a final status that names no response event, is no event."""
    if status not in ("finished", "failed", "cancelled"):
        return None
    name = f"response.{final_status or response_status(status, result)}"
    return name if name in RESPONSE_EVENTS else None


def batch_event_type(status: str) -> str | None:
    """`batch.<status>` for a batch's terminal status, else None."""
    name = f"batch.{status}"
    return name if name in BATCH_EVENTS else None


# ---------------------------------------------------------------- the outbox

# Lua, prepended to the scripts that end a job (`workers.scripts`, `workers.cluster_step`):
# one HMGET at the final write (after its HSET of the record's end); an XADD only for a
# record marked `NOTIFY_FIELD`, with the response's final status when the record has it.
NOTIFY_LUA = f"""
local function llmq_notify(record_key, outbox, job_id, status)
  local got = redis.call('HMGET', record_key, '{NOTIFY_FIELD}', '{RESPONSE_STATUS_FIELD}')
  local kind, final = got[1], got[2]
  if kind and status then
    if final then
      redis.call('XADD', outbox, '*', 'kind', kind, 'id', job_id, 'status', status,
                 '{RESPONSE_STATUS_FIELD}', final)
    else
      redis.call('XADD', outbox, '*', 'kind', kind, 'id', job_id, 'status', status)
    end
  end
end
"""
# KEYS: record, outbox. ARGV: job id, status. For `wire.events.write_ending`'s pipeline.
_NOTIFY = NOTIFY_LUA + "llmq_notify(KEYS[1], KEYS[2], ARGV[1], ARGV[2])\nreturn 0\n"


def queue_notify(pipe: Any, job_id: str, status: str) -> None:
    """Add to `pipe` (a transaction, with the job's terminal write): the outbox entry of the
    job's end, if its record is marked as notifying."""
    pipe.eval(_NOTIFY, 2, keys.job(job_id), keys.WEBHOOK_OUTBOX, job_id, status)


def queue_batch_event(pipe: Any, batch_id: str, status: str) -> None:
    """Add to `pipe` (with the batch's terminal write): the outbox entry of its end."""
    fields = {"kind": NOTIFY_BATCH, "id": batch_id, "status": status}
    pipe.xadd(keys.WEBHOOK_OUTBOX, fields)


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """One terminal write that notifies: `at` is when it was written (the entry's id, ms);
    `response_status` the response's final status ("" in a batch's entry, and in one
    written by a version before the terminal write carried it)."""

    entry_id: str
    kind: str
    id: str
    status: str
    response_status: str = ""

    @property
    def at_ms(self) -> int:
        return int(self.entry_id.split("-")[0])

    @classmethod
    def from_entry(cls, entry_id: bytes | str, fields: Mapping[Any, Any]) -> OutboxEntry:
        f = {as_str(k): as_str(v) for k, v in fields.items()}
        return cls(
            as_str(entry_id),
            f.get("kind", ""),
            f.get("id", ""),
            f.get("status", ""),
            f.get(RESPONSE_STATUS_FIELD, ""),
        )


def event_id(event_type: str, object_id: str) -> str:
    """The event's id, a function of what it says: a re-dispatch or a twice-written end
    names the same event (receivers dedupe by `webhook-id`, which is this)."""
    digest = hashlib.sha256(f"{event_type}|{object_id}".encode()).hexdigest()
    return f"evt_{digest[:32]}"


def event_body(event_type: str, object_id: str, created_at: int) -> dict[str, Any]:
    """The JSON a receiver gets: what ended and how, never the prompt or the output."""
    return {
        "object": "event",
        "id": event_id(event_type, object_id),
        "type": event_type,
        "created_at": created_at,
        "data": {"id": object_id},
    }


# ---------------------------------------------------------------- endpoints


@dataclass
class Endpoint:
    id: str
    url: str
    events: list[str]
    secret: str
    created_at: int = field(default_factory=lambda: int(time.time()))

    def public(self) -> dict[str, Any]:
        """What listings show: everything but the secret."""
        return {k: v for k, v in asdict(self).items() if k != "secret"}

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Endpoint:
        return cls(**json.loads(raw))


def url_problem(url: Any) -> str | None:
    """Why `url` cannot be an endpoint's (None if it can): http or https with a host."""
    if not isinstance(url, str) or not url or len(url) > MAX_URL_LENGTH:
        return f"url must be a string of 1 to {MAX_URL_LENGTH} characters."
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port out of range
    except ValueError as exc:
        return f"url is not a valid URL: {exc}."
    if parts.scheme not in ("http", "https"):
        return f"url must be http or https, got {parts.scheme or 'none'!r}."
    if not parts.hostname:
        return "url must name a host."
    if parts.username or parts.password:
        return "url must not carry credentials."
    if any(c.isspace() for c in url):
        return "url must not contain whitespace."
    return None


def events_problem(events: Any) -> str | None:
    """Why `events` cannot be an endpoint's subscriptions (None if it can)."""
    if not isinstance(events, list) or not events:
        return f"events must be a non-empty list of {', '.join(EVENT_TYPES)}."
    for name in events:
        if name not in EVENT_TYPES:
            return f"events: {str(name)[:80]!r} is not one of {', '.join(EVENT_TYPES)}."
    return None


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def create_endpoint(conn: Any, url: str, events: Iterable[str]) -> Endpoint:
    endpoint = Endpoint(
        id=ENDPOINT_ID_PREFIX + secrets.token_hex(12),
        url=url,
        events=list(dict.fromkeys(events)),
        secret=new_secret(),
    )
    conn.hset(keys.WEBHOOKS, endpoint.id, endpoint.to_json())
    return endpoint


def all_endpoints(conn: Any) -> list[Endpoint]:
    """Every endpoint, oldest first."""
    found = [Endpoint.from_json(raw) for raw in conn.hgetall(keys.WEBHOOKS).values()]
    return sorted(found, key=lambda e: (e.created_at, e.id))


def get_endpoint(conn: Any, endpoint_id: str) -> Endpoint | None:
    raw = conn.hget(keys.WEBHOOKS, endpoint_id)
    return None if raw is None else Endpoint.from_json(raw)


def delete_endpoint(conn: Any, endpoint_id: str) -> bool:
    with conn.pipeline() as pipe:
        pipe.hdel(keys.WEBHOOKS, endpoint_id)
        pipe.delete(keys.webhook_deliveries(endpoint_id))
        return bool(pipe.execute()[0])


# ---------------------------------------------------------------- the delivery log


@dataclass
class DeliveryAttempt:
    """One POST to an endpoint (or one refused before it was sent)."""

    delivery: str  # the RQ job's id: one per (event, endpoint)
    event_id: str
    type: str
    attempt: int
    status: int | None  # the receiver's HTTP status, None when none came
    error: str | None  # why it failed (None: a 2xx)
    ms: float
    at: float

    @property
    def ok(self) -> bool:
        return self.error is None


def log_delivery(conn: Any, endpoint_id: str, attempt: DeliveryAttempt) -> None:
    key = keys.webhook_deliveries(endpoint_id)
    with conn.pipeline(transaction=False) as pipe:
        pipe.lpush(key, json.dumps(asdict(attempt)))
        pipe.ltrim(key, 0, DELIVERY_LOG_LENGTH - 1)
        pipe.execute()


def read_deliveries(conn: Any, endpoint_id: str, limit: int = DELIVERY_LOG_LENGTH) -> list[dict]:
    """The endpoint's last attempts, newest first."""
    raw = conn.lrange(keys.webhook_deliveries(endpoint_id), 0, max(limit, 1) - 1)
    return [json.loads(r) for r in raw]
