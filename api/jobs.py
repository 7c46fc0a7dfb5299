"""The `jobs` blueprint: async jobs — submit, poll, follow events (SSE), cancel."""

from __future__ import annotations

import json
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request

from api import store
from api.auth import caller_scope, require_api_key
from api.bodies import Job, JobList
from api.body import json_object
from api.config import events_conn, redis_conn
from api.errors import APIError, InvalidRequest
from api.flow import accepted, submit_request
from api.paging import int_arg, list_page
from api.schemas import parse_request
from api.streams.events import parse_event_id, sse
from api.streams.relay import sse_response
from api.streams.stream_hub import Event
from workers import keys
from workers.wire.events import EVENT_ERROR, StreamError, StreamEvent, StreamToken
from workers.wire.job import ENDPOINTS, JOB_STATUSES, TERMINAL_STATUSES, JobRecord

bp = Blueprint("jobs", __name__, url_prefix="/v1/jobs")
bp.before_request(require_api_key)


def _job_id(job_id: str) -> str:
    if not keys.is_valid_job_id(job_id):
        raise InvalidRequest(
            "Invalid job id: expected 1 to 64 characters from [A-Za-z0-9_-].", param="id"
        )
    return job_id


JOB_SHAPE = (
    'a job is {"endpoint": "/v1/chat/completions", "body": {...}}: the endpoint to run and '
    "the request body you would POST to it"
)


@bp.post("")
def create_job() -> Response:
    body = json_object({"endpoint", "body"}, JOB_SHAPE)
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise InvalidRequest(
            f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}; {JOB_SHAPE}.",
            param="endpoint",
        )
    inner = body.get("body")
    if not isinstance(inner, dict):
        raise InvalidRequest(f"body must be a JSON object; {JOB_SHAPE}.", param="body")
    req = parse_request(endpoint, inner)
    if req.stream:
        raise InvalidRequest(
            "stream is not available for async jobs; follow GET /v1/jobs/{id}/events.",
            param="body.stream",
        )
    return accepted(submit_request(endpoint, req).record)


def job_view(conn: Any, record: JobRecord) -> Job:
    """The job object `GET /v1/jobs/{id}` answers with; optional fields only when set."""
    completion_tokens = record.completion_tokens
    if record.result and isinstance(record.result.get("usage"), dict):
        completion_tokens = record.result["usage"].get("completion_tokens", completion_tokens)
    elif record.status not in TERMINAL_STATUSES:
        length = events_conn().xlen(keys.job_events(record.id))
        completion_tokens = max(completion_tokens, length)
    view: dict[str, Any] = {
        "id": record.id,
        "object": "job",
        "endpoint": record.endpoint,
        "model": record.responds_as,
        "status": record.status,
        "priority": record.priority,
        "created_at": record.created_at,
        "started_at": record.started_at,
        "finished_at": record.finished_at,
        "attempts": record.attempts,
        "preemptions": record.preemptions,
        "progress": {"completion_tokens": completion_tokens},
    }
    if isinstance(record.request.get("metadata"), dict):
        view["metadata"] = record.request["metadata"]
    if record.result is not None:
        view["result"] = record.result
    if record.error is not None:
        view["error"] = record.error.get("error", record.error)
    return Job(**view)


@bp.get("")
def list_jobs() -> Response:
    """The caller's jobs (sync and async; not a batch's lines), newest first, in OpenAI's
    cursor-paged list shape; `status` keeps one status."""
    limit = int_arg("limit", 20, 1, 100)
    status = request.args.get("status")
    if status is not None and status not in JOB_STATUSES:
        raise InvalidRequest(
            f"status must be one of {', '.join(JOB_STATUSES)}, got {status!r}.", param="status"
        )
    conn = redis_conn()
    records, more = store.list_jobs(conn, limit, request.args.get("after"), caller_scope(), status)
    return jsonify(list_page(JobList, [job_view(conn, record) for record in records], more))


@bp.get("/<job_id>")
def get_job(job_id: str) -> Response:
    conn = redis_conn()
    record = store.require_record(conn, _job_id(job_id), caller_scope())
    return jsonify(job_view(conn, record).dump())


@bp.post("/<job_id>/cancel")
def cancel_job(job_id: str) -> Response:
    conn = redis_conn()
    scope = caller_scope()
    store.cancel(conn, _job_id(job_id), scope)
    record = store.require_record(conn, job_id, scope)
    response = jsonify(job_view(conn, record).dump())
    response.status_code = 202
    return response


@bp.get("/<job_id>/events")
def job_events(job_id: str) -> Response:
    """SSE of the job's stream from the start, or after `Last-Event-ID` / `?after=`."""
    conn = redis_conn()
    _job_id(job_id)
    if "after" in request.args:
        after = parse_event_id(request.args["after"], "after")
    else:
        after = parse_event_id(request.headers.get("Last-Event-ID"))
    store.require_record(conn, job_id, caller_scope())
    # A listener that hangs up cancels nothing: async jobs outlive their watchers.
    return sse_response(job_id, JobEventRenderer(current_app.config["SSE_RETRY_MS"]), after=after)


class JobEventRenderer:
    """A job's events as `/v1/jobs/{id}/events` shows them: `event: token|done|error`, each
    with its stream entry id as `id:` (docs/contract.md, Async jobs), after a `retry:`."""

    def __init__(self, retry_ms: int) -> None:
        self.retry_ms = retry_ms

    def start(self) -> str:
        return f"retry: {self.retry_ms}\n\n"

    def events(self, batch: list[Event]) -> str:
        return "".join(
            sse(json.dumps(_public_data(e.message), ensure_ascii=False), event=e.kind, id=e.id)
            for e in batch
        )

    def error(self, error: APIError) -> str:
        """Said in-band; the client reconnects and resumes from its Last-Event-ID."""
        return sse(json.dumps(error.body()), event=EVENT_ERROR)


def _public_data(event: StreamEvent) -> dict[str, Any]:
    """What `/v1/jobs/{id}/events` shows of an event (docs/contract.md, Async jobs)."""
    if isinstance(event, StreamToken):
        return {
            "index": event.index,
            "text": event.text,
            "choice": event.choice,
            "token_id": event.token_id,
        }
    if isinstance(event, StreamError):
        return {"error": event.error}
    return event.to_data()
