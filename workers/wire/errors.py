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
