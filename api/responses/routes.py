"""The `responses` blueprint: OpenAI's Responses API on the job system.

A response is a chat-completion job whose record also carries the Responses request
(api/responses/requests.py translates it; workers/wire/responses_api.py renders the answer);
the job id is the response id, so no other index exists. It runs on the same queues and
workers as every job, and survives what a job survives: its stream events are derived from
the job's event stream (api/responses/events.py), so any API process replays them.

`POST /v1/responses` answers as the request asks: the finished response, its events (SSE;
a client that disconnects cancels it unless it runs in the background), or at once with
status `queued` (`background`). `GET /v1/responses/{id}` (`?stream=true&starting_after=N`:
the events after N), `POST .../cancel`, `DELETE`, `GET .../input_items`.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request

from api import store
from api.auth import caller_scope, require_api_key, visible
from api.body import json_object
from api.config import events_conn, redis_conn
from api.errors import (
    APIError,
    Conflict,
    ExpiredOrMissing,
    InvalidRequest,
    QueueFull,
    UnsupportedFeature,
)
from api.flow import error_from_event, submit_request, wait_end
from api.paging import int_arg
from api.responses.events import ResponseEvents, error_job_status
from api.responses.requests import (
    new_response_id,
    parse_response_request,
    translate,
)
from api.streams.events import sse
from api.streams.relay import sse_response
from api.streams.stream_hub import Event
from workers import keys
from workers.wire import responses_api as wire
from workers.wire.events import StreamDone, StreamError
from workers.wire.job import (
    CANCELLED,
    CHAT_COMPLETIONS,
    FINISHED,
    TERMINAL_STATUSES,
    JobRecord,
)
from workers.wire.webhooks import NOTIFY_RESPONSE, notify_fields

bp = Blueprint("responses", __name__, url_prefix="/v1/responses")
bp.before_request(require_api_key)

CANCEL_WAIT_SECONDS = 3.0  # how long cancel and delete wait for a running job to stop
# a `store: false` response's record and stream, once its answer went out: nobody may read
# them again, so they go soon instead of after JOB_TTL_SECONDS (the webhooks' dispatcher
# reads the record of an ended job within this)
UNSTORED_TTL_SECONDS = 60


class ResponseNotFound(ExpiredOrMissing):
    noun, param, code = "response", "response_id", "response_not_found"


class FlexUnavailable(APIError):
    """The flex tier is refused while the model's queues are long (`FLEX_MAX_QUEUE`)."""

    status = 429
    type = "rate_limit_error"
    code = "flex_queue_full"

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"The flex tier takes no requests while {limit} or more jobs wait for this "
            "model; retry later, or use service_tier 'default'.",
            param="service_tier",
            headers={"Retry-After": "2"},
        )


def flex_max_queue() -> int:
    """The queue depth at which flex requests are refused: LLMQ_FLEX_MAX_QUEUE, and never
    above LLMQ_MAX_QUEUE (0 in either: that one sets no limit)."""
    config = current_app.config
    limits = [n for n in (config["FLEX_MAX_QUEUE"], config["MAX_QUEUE"]) if n > 0]
    return min(limits) if limits else 0


def stored_response(conn: Any, response_id: str, scope: str | None) -> JobRecord:
    """A stored response of the caller's; 404 otherwise (a job that is not a response, one
    created with store false, another key's, or one that expired)."""
    record = None
    if keys.is_valid_job_id(response_id) and wire.is_response_id(response_id):
        record = store.get_record(conn, response_id)
    if (
        record is None
        or record.responses is None
        or not wire.stored_request(record).store
        or not visible(record.owner, scope)
    ):
        raise ResponseNotFound(response_id)
    return record


# ---------------------------------------------------------------- create


@bp.post("")
def create_response() -> Response:
    req = parse_response_request(json_object())
    conn = redis_conn()
    context: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        try:
            previous = stored_response(conn, req.previous_response_id, caller_scope())
        except ResponseNotFound:
            raise InvalidRequest(
                f"Previous response with id {req.previous_response_id!r} not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            ) from None
        if previous.status not in TERMINAL_STATUSES:
            raise InvalidRequest(
                f"Previous response {req.previous_response_id!r} has not finished yet.",
                param="previous_response_id",
                code="previous_response_in_progress",
            )
        context = wire.conversation(previous)
    response_id = new_response_id()
    flex = req.tier == "flex"
    try:
        translation = translate(req, response_id, context)
        submission = submit_request(
            CHAT_COMPLETIONS,
            translation.chat,
            job_id=response_id,
            responses=translation.stored.encode(),
            max_queue=flex_max_queue() if flex else None,
            # a background response's end is a `response.*` webhook event, as at OpenAI
            marks=notify_fields(NOTIFY_RESPONSE) if req.background else None,
        )
    except QueueFull:
        if flex:
            raise FlexUnavailable(flex_max_queue()) from None
        raise
    record = submission.record
    if req.stream:
        return stream_events(
            record, -1, cancel_on_disconnect=not req.background, forget=not req.store
        )
    if req.background:
        return jsonify(wire.render(record))
    end = wait_end(record)
    if end is None:
        return Response(status=499)  # nobody reads it; keeps the access log honest
    if not req.store:
        _forget(conn, events_conn(), record.id)
    if isinstance(end, StreamError) and error_job_status(end.to_data()) != CANCELLED:
        return error_from_event(end)
    return jsonify(wire.render(_ended(record, end)))


def _forget(conn: Any, events: Any, response_id: str) -> None:
    """Let a `store: false` response's record and stream expire soon."""
    conn.expire(keys.job(response_id), UNSTORED_TTL_SECONDS)
    events.expire(keys.job_events(response_id), UNSTORED_TTL_SECONDS)


def _ended(record: JobRecord, end: StreamDone | StreamError) -> JobRecord:
    """`record` as its terminal event left it (the record itself may be written after the
    event, when the streams live on their own cluster)."""
    record.finished_at = record.finished_at or time.time()
    if isinstance(end, StreamDone):
        record.status, record.result = FINISHED, end.result
    else:
        record.status = error_job_status(end.to_data())
        record.error = end.to_data()
    return record


# ---------------------------------------------------------------- events


def stream_events(
    record: JobRecord, after: int, *, cancel_on_disconnect: bool, forget: bool = False
) -> Response:
    """The response's events after sequence number `after`, as SSE (`event:` + `data:`),
    derived again from the start of its job's stream; `forget`: a `store: false` response,
    whose record and stream expire soon once its end went out."""
    conn, events = redis_conn(), events_conn()  # the generator runs outside the app context
    cancel = functools.partial(store.flag_and_dequeue, conn, record.id)
    expire = functools.partial(_forget, conn, events, record.id)
    return sse_response(
        record.id,
        ResponseEventRenderer(ResponseEvents(record), after),
        on_hang_up=cancel if cancel_on_disconnect else None,
        on_end=expire if forget else None,
    )


class ResponseEventRenderer:
    """A response's typed events (api/responses/events.py), those numbered after `after`
    (a client resuming with `starting_after`); an error is OpenAI's `error` event."""

    def __init__(self, derive: ResponseEvents, after: int) -> None:
        self.derive, self.after = derive, after

    def start(self) -> str:
        return self._messages(self.derive.start())

    def events(self, batch: list[Event]) -> str:
        return self._messages([e for event in batch for e in self.derive.feed(event.message)])

    def error(self, error: APIError) -> str:
        return _error_event(self.derive, error)

    def _messages(self, events: list[dict[str, Any]]) -> str:
        return "".join(
            sse(json.dumps(e, ensure_ascii=False), event=e["type"])
            for e in events
            if e["sequence_number"] > self.after
        )


def _error_event(derive: ResponseEvents, error: APIError) -> str:
    """OpenAI's stream `error` event; it numbers after the events derived so far."""
    body = error.body()["error"]
    event = {
        "type": "error",
        "sequence_number": derive.sequence,
        "code": body.get("code"),
        "message": body.get("message"),
        "param": body.get("param"),
    }
    return sse(json.dumps(event, ensure_ascii=False), event="error")


# ---------------------------------------------------------------- retrieve, cancel, delete


def _flag(name: str) -> bool:
    raw = request.args.get(name)
    if raw is None or raw.lower() in ("false", "0", ""):
        return False
    if raw.lower() in ("true", "1"):
        return True
    raise InvalidRequest(f"{name} must be true or false, got {raw!r}.", param=name)


def _no_include() -> None:
    if request.args.getlist("include") or request.args.getlist("include[]"):
        raise UnsupportedFeature("include is not supported by this server.", param="include")


@bp.get("/<response_id>")
def retrieve_response(response_id: str) -> Response:
    _no_include()
    if _flag("include_obfuscation"):
        raise UnsupportedFeature(
            "include_obfuscation is not supported by this server.", param="include_obfuscation"
        )
    stream = _flag("stream")
    after = -1
    if "starting_after" in request.args:
        after = int_arg("starting_after", -1, -1, 2**31 - 1)
        if not stream:
            raise InvalidRequest("starting_after needs stream=true.", param="starting_after")
    record = stored_response(redis_conn(), response_id, caller_scope())
    if stream:
        return stream_events(record, after, cancel_on_disconnect=False)
    return jsonify(wire.render(record))


def _stop(conn: Any, record: JobRecord, scope: str | None) -> JobRecord:
    """Cancel a response's job if it has not ended, and wait a little for its end."""
    if record.status in TERMINAL_STATUSES:
        return record
    try:
        store.cancel(conn, record.id, scope)
    except Conflict:  # it ended meanwhile
        pass
    deadline = time.monotonic() + CANCEL_WAIT_SECONDS
    while True:
        current = store.get_record(conn, record.id) or record
        if current.status in TERMINAL_STATUSES or time.monotonic() > deadline:
            return current
        time.sleep(0.05)


@bp.post("/<response_id>/cancel")
def cancel_response(response_id: str) -> Response:
    """Cancel a background response (OpenAI cancels only those); one that has ended is
    answered as it is."""
    conn = redis_conn()
    scope = caller_scope()
    record = stored_response(conn, response_id, scope)
    if not wire.stored_request(record).background:
        raise InvalidRequest(
            "Only responses created with background true can be cancelled.", param="response_id"
        )
    return jsonify(wire.render(_stop(conn, record, scope)))


@bp.delete("/<response_id>")
def delete_response(response_id: str) -> Response:
    """Delete a stored response (its record and its event stream); a running one is
    cancelled first."""
    conn = redis_conn()
    scope = caller_scope()
    record = _stop(conn, stored_response(conn, response_id, scope), scope)
    if record.status not in TERMINAL_STATUSES:
        raise Conflict(
            f"Response {response_id} is still stopping; delete it again in a moment.",
            code="response_running",
        )
    conn.delete(keys.job(response_id))
    events_conn().delete(keys.job_events(response_id))
    return jsonify(
        wire.ResponseDeleted(id=response_id, object="response.deleted", deleted=True).dump()
    )


@bp.get("/<response_id>/input_items")
def list_input_items(response_id: str) -> Response:
    """The input the response ran on (the previous responses' items, then its own), in
    OpenAI's cursor-paged list shape; `order` desc (the default) or asc."""
    _no_include()
    limit = int_arg("limit", 20, 1, 100)
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order must be asc or desc, got {order!r}.", param="order")
    record = stored_response(redis_conn(), response_id, caller_scope())
    asked = wire.stored_request(record)
    items = [*asked.context, *asked.input]
    if order == "desc":
        items = items[::-1]
    after = request.args.get("after")
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    body = wire.ResponseItemList(
        object="list",
        data=page,
        first_id=page[0]["id"] if page else None,
        last_id=page[-1]["id"] if page else None,
        has_more=len(items) > limit,
    )
    return jsonify(body.dump())
