"""Named API errors and the one error handler that renders every failure in OpenAI's shape.

Every error body is `{"error": {"message", "type", "param", "code"}}`, whatever raised it:
our own `APIError`s, Flask/Werkzeug's HTTP errors (404, 405, 413, 415, ...), Redis being
unreachable (503 + Retry-After, docs/faults.md F7), this process's Redis connections all
busy (503 `redis_pool_exhausted`, never `broker_down`) and unexpected exceptions (500, logged with
their traceback but never with it in the body).
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from flask import Flask, Response, g, jsonify
from werkzeug.exceptions import HTTPException

from workers.wire.broker import NotReplicated, PoolExhausted
from workers.wire.errors import OpenAIError, openai_error

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 2


class APIError(OpenAIError):
    """An error the API answers with at once: its HTTP status, OpenAI's error body
    (`OpenAIError`, shared with the workers' errors) and any headers it needs."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, param, code=code)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """What the HTTP answer carries."""
        return self.openai_body()


class InvalidRequest(APIError):
    status = 400


class UnsupportedFeature(InvalidRequest):
    """A contract feature the engine does not implement yet; never silently ignored."""

    code = "unsupported"


class AuthenticationFailed(APIError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": 'Bearer realm="llmq"'})


class PermissionDenied(APIError):
    status = 403
    type = "permission_error"
    code = "forbidden"


class NotFound(APIError):
    status = 404
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model {model!r} does not exist.", param="model")


class ExpiredOrMissing(NotFound):
    """An id of something stored with a TTL (a job, file or batch): it may never have
    existed, or it may have expired; subclasses name the thing, its `param` and `code`."""

    noun = "object"

    def __init__(self, ident: str) -> None:
        super().__init__(f"No {self.noun} with id {ident!r} (it may have expired).")


class JobNotFound(ExpiredOrMissing):
    noun, param, code = "job", "id", "job_not_found"


class FileNotFound(ExpiredOrMissing):
    noun, param, code = "file", "file_id", "file_not_found"


class BatchNotFound(ExpiredOrMissing):
    noun, param, code = "batch", "batch_id", "batch_not_found"


class PayloadTooLarge(APIError):
    status = 413
    code = "payload_too_large"


class Conflict(APIError):
    status = 409
    code = "conflict"


class NotImplementedYet(APIError):
    status = 501
    type = "not_implemented_error"
    code = "not_implemented"


class InternalError(APIError):
    """Anything unexpected: logged with its traceback, answered without it."""

    status = 500
    type = "server_error"
    code = "internal_error"

    def __init__(self) -> None:
        super().__init__("Internal server error.")


class QueueFull(APIError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"

    def __init__(self, queue: str, depth: int, retry_after: int = RETRY_AFTER_SECONDS) -> None:
        super().__init__(
            f"The queue for this model is full ({depth} jobs waiting); retry later.",
            headers={"Retry-After": str(retry_after)},
        )
        self.queue = queue


class RateLimited(APIError):
    """Past a caller's per-minute limit (`api.rate_limits`): OpenAI's 429, whose `type`
    names the limit that was hit ("requests" or "tokens")."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})
        self.type = limit


class RequestTooLarge(InvalidRequest):
    """A request that needs more tokens than the whole tokens-per-minute limit: it could
    never pass, so it is refused as a mistake (400), not as a 429 clients would retry."""

    code = "request_too_large"


class ServiceUnavailable(APIError):
    status = 503
    type = "service_unavailable_error"
    code = "service_unavailable"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


class NoWorker(ServiceUnavailable):
    def __init__(self, model: str) -> None:
        super().__init__(
            f"No live worker serves the model {model!r} right now; retry later.",
            code="no_worker",
        )


def pool_exhausted() -> ServiceUnavailable:
    """This process's Redis connections all stayed busy (`LLMQ_API_REDIS_CONNECTIONS`):
    the API is overloaded, the broker is not down, so it is not `broker_down`."""
    return ServiceUnavailable(
        "This API process is busy (all its Redis connections are in use); retry later.",
        code="redis_pool_exhausted",
    )


def error_response(error: APIError) -> Response:
    response = jsonify(error.body())
    response.status_code = error.status
    response.headers.update(error.headers)
    return response


_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


def _http_error(exc: HTTPException) -> Response:
    status = exc.code or 500
    message = exc.description or exc.name
    if status == 413:
        message = f"Request body too large; the limit is {_max_content_length() or 0} bytes."
    type_ = _HTTP_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    response = jsonify(openai_error(message, type_, None, exc.name.lower().replace(" ", "_")))
    response.status_code = status
    for name, value in exc.get_headers():
        if name.lower() not in ("content-type", "content-length"):
            response.headers[name] = value  # keeps Allow on 405
    return response


def _max_content_length() -> int | None:
    from flask import current_app

    return current_app.config.get("MAX_CONTENT_LENGTH")


def register_error_handlers(app: Flask) -> None:
    """One handler per family; all produce the OpenAI shape."""

    app.register_error_handler(APIError, error_response)
    app.register_error_handler(HTTPException, _http_error)

    @app.errorhandler(NotReplicated)
    def _not_replicated(exc: NotReplicated) -> Response:
        log.warning("not acknowledged: %s", exc)
        return error_response(
            ServiceUnavailable(
                "The job broker could not confirm the write on its replicas, so nothing was "
                "accepted; retry later.",
                code="not_replicated",
            )
        )

    @app.errorhandler(PoolExhausted)
    @app.errorhandler(redis.exceptions.MaxConnectionsError)  # a capped Sentinel pool
    def _pool_exhausted(exc: Exception) -> Response:
        log.warning("Redis connections exhausted: %s", exc)
        return error_response(pool_exhausted())

    @app.errorhandler(redis.exceptions.ConnectionError)
    @app.errorhandler(redis.exceptions.TimeoutError)
    @app.errorhandler(redis.exceptions.ReadOnlyError)  # a demoted master (wire.broker)
    def _broker_down(exc: Exception) -> Response:
        log.warning("Redis unavailable: %s", exc.__class__.__name__)
        g.broker_down = True
        return error_response(
            ServiceUnavailable("The job broker is unavailable; retry later.", code="broker_down")
        )

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error")
        return error_response(InternalError())


class AdapterNotFound(NotFound):
    code = "adapter_not_found"

    def __init__(self, name: str, model: str) -> None:
        super().__init__(
            f"The LoRA adapter {name!r} is not loaded for model {model!r}.", param="lora"
        )
