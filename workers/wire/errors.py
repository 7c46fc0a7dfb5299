"""The OpenAI error body, built here and nowhere else (API responses, `error` events, job
records and batch error lines all carry it)."""

from __future__ import annotations

from typing import Any, TypeVar


def openai_error(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    status: int = 400,
) -> dict[str, Any]:
    """OpenAI's error shape plus the HTTP status the API should answer with: what a job's
    `error` event and record `error` hold."""
    return {**openai_error(message, type_, param, code), "status": status}


def cancelled_error() -> dict[str, Any]:
    """The `error` event data (and record `error`) of a cancelled job."""
    return error_body("The job was cancelled.", code="cancelled", status=409)


class OpenAIError(Exception):
    """An error that reaches a client as OpenAI's error body: the base of the API's errors
    (`api.errors.APIError`, answered at once) and of the workers' (`workers.errors.JobFailure`,
    which end a job and reach the client through its `error` event). Subclasses set `status`,
    `type` and `code`; `param` names the request field at fault, when there is one."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None
    param: str | None = None

    def __init__(self, message: str, param: str | None = None, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code

    def openai_body(self) -> dict[str, Any]:
        """`{"error": {...}}`: what an HTTP answer carries."""
        return openai_error(self.message, self.type, self.param, self.code)

    def job_body(self) -> dict[str, Any]:
        """The OpenAI body plus `status`: what a job's `error` event and record carry."""
        return error_body(self.message, self.type, self.param, self.code, self.status)


Refusal = TypeVar("Refusal", bound=OpenAIError)


def engine_refusal(
    exc: Exception,
    kind: type[Refusal],
    *,
    default_param: str | None = None,
    as_sentence: bool = False,
) -> Refusal:
    """An engine error a user caused (a `runtime.errors.LLMQRuntimeError`: an empty prompt,
    a context overflow, bad sampling values, no chat template) as the client error `kind`:
    the API's `InvalidRequest` at submission (`api.flow.check_context`), a worker's
    `InvalidJobRequest` before the first token (`workers.requests.invalid_request`). Both
    read the field from the error's own `param` here, so the two can never disagree on it.

    `default_param` names the field when the engine named none; `as_sentence` words the
    message as the API's other 400s are worded, where a worker keeps the engine's words
    (job records and batch error lines already carry them). The error is duck-typed, since
    this module imports nothing of the engine (docs/architecture.md).
    """
    message = str(exc)
    if as_sentence:
        message = message[:1].upper() + message[1:] + ("" if message.endswith(".") else ".")
    return kind(message, param=getattr(exc, "param", None) or default_param)
