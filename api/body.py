"""Strict JSON request bodies.

Flask's `request.get_json()` accepts NaN/Infinity, lone surrogates and unbounded nesting
(which raises RecursionError, a 500). Every POST body goes through `json_object()` instead,
so malformed input always ends as a 400/413/415 in OpenAI's shape (docs/faults.md, the M rows).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from flask import current_app, request
from werkzeug.exceptions import RequestEntityTooLarge

from api.errors import APIError, InvalidRequest
from runtime.json_calls import json_type

MAX_JSON_DEPTH = 64  # far more than any valid request needs


class UnsupportedMediaType(APIError):
    status = 415
    code = "unsupported_media_type"


def _reject_constant(name: str) -> Any:
    raise InvalidRequest(f"Invalid JSON: {name} is not allowed; numbers must be finite.")


def _depth(value: Any, limit: int) -> int:
    """Nesting depth, iteratively (a recursive walk would itself overflow)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > limit:
            return depth
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return deepest


def _has_lone_surrogate(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_json(raw: bytes) -> Any:
    """Decode a JSON document strictly; raises `InvalidRequest` with a useful message."""
    if not raw.strip():
        raise InvalidRequest("The request body is empty; expected a JSON object.")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"The request body is not valid UTF-8 (byte {exc.start}).") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"Invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})."
        ) from None
    except RecursionError:
        raise InvalidRequest(f"Invalid JSON: nested deeper than {MAX_JSON_DEPTH} levels.") from None
    if _depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"Invalid JSON: nested deeper than {MAX_JSON_DEPTH} levels.")
    if _has_lone_surrogate(value):
        raise InvalidRequest("Invalid JSON: strings must not contain lone surrogates.")
    return value


def json_object(fields: Collection[str] | None = None, shape: str = "") -> dict[str, Any]:
    """The current request's body as a JSON object (415 if it is not sent as JSON). With
    `fields`, a key outside them is refused as OpenAI does (400 naming the first in sorted
    order), `shape` (what the body should be) added to the message."""
    if not request.mimetype or not (
        request.mimetype == "application/json" or request.mimetype.endswith("+json")
    ):
        raise UnsupportedMediaType(
            f"Content-Type must be application/json, got {request.mimetype or 'none'!r}."
        )
    value = parse_json(_read_body())
    if not isinstance(value, dict):
        raise InvalidRequest(f"The request body must be a JSON object, got {json_type(value)}.")
    unknown = sorted(set(value) - set(fields)) if fields is not None else []
    if unknown:
        message = f"Unrecognized request argument supplied: {unknown[0]}"
        raise InvalidRequest(message + (f"; {shape}." if shape else ""), param=unknown[0])
    return value


def _read_body() -> bytes:
    """The body, at most MAX_CONTENT_LENGTH bytes, whether or not Content-Length was sent.

    Werkzeug cuts a chunked body at the limit and may hand back the truncated prefix as if
    it were complete; a body that reaches the limit without a Content-Length is too large.
    """
    limit = current_app.config.get("MAX_CONTENT_LENGTH")
    if limit is None or request.content_length is not None:
        return request.get_data(cache=False)  # werkzeug checks a declared length up front
    parts, size = [], 0
    while size < limit:
        part = request.stream.read(min(65536, limit - size))
        if not part:
            return b"".join(parts)
        parts.append(part)
        size += len(part)
    if request.stream.read(1):
        raise RequestEntityTooLarge()
    return b"".join(parts)
