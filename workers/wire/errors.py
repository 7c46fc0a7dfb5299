"""The OpenAI error body, built here and nowhere else (API responses, `error` events, job
records and batch error lines all carry it)."""

from __future__ import annotations

from typing import Any


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
