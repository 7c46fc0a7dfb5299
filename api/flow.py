"""The life of one request: submit a validated job, then answer 202, wait, or stream.

Shared by the `openai` blueprint (the three POSTs) and the `jobs` blueprint (POST /v1/jobs).
"""

from __future__ import annotations

import functools
import re
import time
from typing import Any

from flask import Response, current_app, jsonify, request

from api import loras, rate_limits, store
from api.auth import bearer_token, caller_scope
from api.bodies import JobSummary
from api.chunks import ChunkStream, sse_data
from api.config import redis_conn, replication, stream_hub
from api.errors import APIError, InvalidRequest, ServiceUnavailable
from api.model_texts import ModelTexts
from api.streams.events import DisconnectWatch, follow, idle_tick
from api.streams.relay import sse_response
from api.streams.stream_hub import Event
from api.token_budget import embedding_tokens, reserved_tokens
from runtime.errors import LLMQRuntimeError
from runtime.request import GenerationSpec
from workers.wire.broker import NotReplicated
from workers.wire.errors import engine_refusal
from workers.wire.events import StreamDone, StreamError, StreamEvent, StreamToken
from workers.wire.job import JobRecord

IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")  # printable ASCII, no spaces


def prefers_async() -> bool:
    """RFC 7240 `Prefer: respond-async`."""
    prefs = request.headers.get("Prefer", "")
    return any(p.split(";")[0].strip().lower() == "respond-async" for p in prefs.split(","))


def submit_request(
    endpoint: str,
    req: Any,
    *,
    job_id: str | None = None,
    responses: dict[str, Any] | None = None,
    max_queue: int | None = None,
    marks: dict[str, str] | None = None,
) -> store.Submission:
    """Check the model and the context, then store and enqueue the job (or find its twin).
    A response (api/responses/routes.py) names its id, its Responses request, the fields that
    make its end notify the webhooks (`marks`) and, for the flex tier, a shorter queue it
    may join (`max_queue`)."""
    conn = redis_conn()
    # a snapshot <= 1 s old; read now when it lacks the model (an adapter's name, unknown)
    directory = current_app.extensions["directory"].get(conn, req.model)
    requested = req.model
    loras.resolve(conn, req, directory.models)  # a model naming an adapter; unknown: 404
    info = store.require_model(req.model, directory.models, directory.served)
    spec = req.to_spec()  # once, after the adapters are resolved: checked, then stored
    texts = current_app.extensions.get("model_texts")
    prompt_tokens = check_context(req, spec, info, texts)
    idem = request.headers.get("Idempotency-Key")
    scoped = None
    if idem is not None:
        if not IDEMPOTENCY_KEY.match(idem):
            raise InvalidRequest(
                "Idempotency-Key must be 1 to 255 printable ASCII characters without spaces.",
                param="Idempotency-Key",
            )
        scoped = store.idempotency_key(bearer_token() or "", idem)
    tokens = _tokens(req, spec, prompt_tokens, info, texts)
    admission = rate_limits.admit(tokens, req.param_name("max_tokens") if spec else "input")
    try:
        submission = store.submit(
            conn,
            endpoint,
            req.model,
            req.to_job_request(),
            max_queue=current_app.config["MAX_QUEUE"] if max_queue is None else max_queue,
            idempotency=scoped,
            owner=caller_scope(),
            spec=None if spec is None else spec.to_record(),
            priority=req.priority,
            response_model=requested if requested != req.model else None,
            reservation=None if admission is None else admission.reservation,
            replication=replication(),
            job_id=job_id,
            responses=responses,
            marks=marks,
        )
    except NotReplicated:  # the job exists: its end, or its withdrawal, settles the tokens
        raise
    except Exception:
        rate_limits.give_back(admission, requests=True)  # refused (queue full): costs nothing
        raise
    if not submission.created:  # an Idempotency-Key repeat: the first job holds the tokens
        rate_limits.give_back(admission, requests=False)
    return submission


def _tokens(
    req: Any,
    spec: GenerationSpec | None,
    prompt_tokens: int | None,
    info: dict[str, Any],
    texts: ModelTexts | None,
) -> int:
    """What the request reserves against a tokens-per-minute limit (0 while none is on)."""
    limit = rate_limits.token_limit()
    if limit == 0:
        return 0
    if spec is None:  # embeddings: their input
        return embedding_tokens(req.input, texts.get(req.model) if texts is not None else None)
    context = info.get("context_length")
    context = context if isinstance(context, int) else None
    return reserved_tokens(spec, prompt_tokens, context, limit)


def check_context(
    req: Any,
    spec: GenerationSpec | None,
    info: dict[str, Any],
    texts: ModelTexts | None = None,
) -> int | None:
    """What the model can tell of a request before it is queued: max_tokens against its
    context, and, where this machine has the model's file, everything the engine would
    refuse (prompt + max_tokens beyond the context, token ids outside the vocabulary, chat
    without a chat template), so that a failed job means the system failed. Returns the
    prompt tokens it counted (None where it had no tokenizer), which rate limits reserve."""
    context = info.get("context_length")
    max_tokens = getattr(req, "effective_max_tokens", getattr(req, "max_tokens", None))
    if isinstance(context, int) and isinstance(max_tokens, int) and max_tokens >= context:
        name = req.param_name("max_tokens")
        raise InvalidRequest(
            f"{name} must be less than the model's context length ({context} tokens), "
            f"got {max_tokens}.",
            param=name,
        )
    text = texts.get(req.model) if texts is not None and spec is not None else None
    if text is None:
        return None
    try:
        return text.check(spec, context if isinstance(context, int) else None)
    except LLMQRuntimeError as exc:
        default = "messages" if spec.chat else "prompt"
        error = engine_refusal(exc, InvalidRequest, default_param=default, as_sentence=True)
        error.param = req.param_name(error.param)  # the engine's words, the client's field
        raise error from None


def job_summary(record: JobRecord) -> dict[str, Any]:
    """The 202 body, built with the model `/openapi.json` documents for it."""
    return JobSummary(id=record.id, object="job", status=record.status).dump()


def accepted(record: JobRecord) -> Response:
    response = jsonify(job_summary(record))
    response.status_code = 202
    response.headers["Location"] = f"/v1/jobs/{record.id}"
    response.headers["Preference-Applied"] = "respond-async"
    return response


def error_from_event(event: StreamError) -> Response:
    """An `error` event (OpenAI body plus `status`) as the HTTP response."""
    response = jsonify({"error": event.error or {"message": "Job failed."}})
    response.status_code = event.status
    if event.status in (429, 503):
        response.headers["Retry-After"] = "2"
    return response


def wait_end(record: JobRecord) -> StreamDone | StreamError | None:
    """Follow the job's events until it ends: its terminal event, or None when the client
    went away (the job is then cancelled, as when it runs out of time)."""
    conn = redis_conn()
    watch = DisconnectWatch(request.environ)
    timeout = current_app.config["SYNC_TIMEOUT_SECONDS"]
    deadline = time.monotonic() + timeout
    tick = idle_tick(min(timeout, current_app.config["PING_SECONDS"]))
    for event in follow(stream_hub(), record.id, tick=tick, watch=watch):
        if watch.gone():
            store.flag_and_dequeue(conn, record.id)
            return None
        if event is None:
            if time.monotonic() > deadline:
                store.flag_and_dequeue(conn, record.id)
                raise ServiceUnavailable("The job did not finish in time.", code="timeout")
            continue
        if isinstance(event.message, StreamDone | StreamError):
            return event.message
    raise ServiceUnavailable("The job's event stream ended unexpectedly.")


def wait(record: JobRecord) -> Response:
    """Follow the job's events until it ends; cancel it if the client goes away."""
    end = wait_end(record)
    if end is None:
        return Response(status=499)  # nobody reads it; keeps the access log honest
    if isinstance(end, StreamDone):
        return jsonify(end.result)
    return error_from_event(end)


def stream(record: JobRecord, req: Any) -> Response:
    """OpenAI-style SSE chunks for the job, ending with `data: [DONE]`; a client that hangs
    up cancels the job (api/streams/relay.py)."""
    conn = redis_conn()
    cancel = functools.partial(store.flag_and_dequeue, conn, record.id)
    return sse_response(record.id, ChunkRenderer(ChunkStream(record, req)), on_hang_up=cancel)


class ChunkRenderer:
    """A streamed chat or completion as OpenAI sends it: `data:` chunks (api/chunks.py),
    each end, an error too, followed by `data: [DONE]`."""

    def __init__(self, chunks: ChunkStream) -> None:
        self.chunks = chunks

    def start(self) -> str:
        return "".join(sse_data(chunk) for chunk in self.chunks.start())

    def events(self, batch: list[Event]) -> str:
        return "".join(item for event in batch for item in _chunks_for(self.chunks, event.message))

    def error(self, error: APIError) -> str:
        return sse_data(error.body()) + "data: [DONE]\n\n"


def _chunks_for(chunks: ChunkStream, event: StreamEvent) -> list[str]:
    if isinstance(event, StreamToken):
        message = chunks.token_message(event)
        return [message] if message is not None else []
    if isinstance(event, StreamDone):
        return [sse_data(c) for c in chunks.done(event.result)] + ["data: [DONE]\n\n"]
    if isinstance(event, StreamError):
        return [sse_data({"error": event.error}), "data: [DONE]\n\n"]
    return []  # kinds this version does not know are not part of the OpenAI stream


def respond(endpoint: str, req: Any) -> Response:
    """Submit and answer as the client asked: 202, SSE, or the finished body."""
    is_async = prefers_async()
    if is_async and req.stream:
        raise InvalidRequest(
            "stream cannot be combined with Prefer: respond-async; "
            "follow GET /v1/jobs/{id}/events instead.",
            param="stream",
        )
    submission = submit_request(endpoint, req)
    if is_async:
        return accepted(submission.record)
    if req.stream:
        return stream(submission.record, req)
    return wait(submission.record)
