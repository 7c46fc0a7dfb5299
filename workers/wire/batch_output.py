"""Lines of a batch's output and error files, in OpenAI's format: one JSON object per
request, `{"id", "custom_id", "response", "error"}`."""

from __future__ import annotations

import json
from typing import Any


def batch_request_id(batch_id: str, line: int) -> str:
    """The `id` of a line's record in the output or error file (stable across retries)."""
    return f"batch_req_{batch_id.removeprefix('batch_')}_{line}"


def output_line(batch_id: str, line: int, custom_id: str, job_id: str, body: dict[str, Any]) -> str:
    """One line of a batch's output file: the body the live endpoint would have returned."""
    response = {"status_code": 200, "request_id": job_id, "body": body}
    return _line(batch_id, line, custom_id, response, None)


def error_line(
    batch_id: str,
    line: int,
    custom_id: str | None,
    code: str,
    message: str,
    response: dict[str, Any] | None = None,
) -> str:
    """One line of a batch's error file; `response` is set for a request that ran and
    failed (`{"status_code", "request_id", "body": {"error": ...}}`), else None."""
    return _line(batch_id, line, custom_id, response, {"code": code, "message": message})


def _line(
    batch_id: str,
    line: int,
    custom_id: str | None,
    response: dict[str, Any] | None,
    error: dict[str, Any] | None,
) -> str:
    record = {
        "id": batch_request_id(batch_id, line),
        "custom_id": custom_id,
        "response": response,
        "error": error,
    }
    return json.dumps(record, ensure_ascii=False)
