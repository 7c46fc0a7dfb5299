"""Validating a batch input file line by line, exactly as the live endpoints validate.

Each non-blank line must be `{"custom_id", "method": "POST", "url": <the batch's endpoint>,
"body": {...}}`, with a body that `api.schemas.parse_request` accepts for that endpoint and
a model that exists. A bad line never fails the batch: it becomes an error record carrying
its custom_id (when it has a usable one) and the valid lines run. A custom_id seen on an
earlier line makes the later line an error, so every custom_id is answered exactly once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from api import loras
from api.body import json_type, parse_json
from api.errors import APIError
from api.flow import check_context
from api.model_texts import ModelTexts
from api.responses.requests import new_response_id, parse_response_request, translate
from api.schemas import parse_request
from workers.wire.defaults import MAX_LINE_BYTES
from workers.wire.job import RESPONSES

BOM = b"\xef\xbb\xbf"
MAX_CUSTOM_ID_CHARS = 512
LINE_FIELDS = ("custom_id", "method", "url", "body")


@dataclass
class ValidLine:
    line: int  # 1-based line number in the input file
    custom_id: str
    model: str
    request: dict[str, Any]  # normalised, as the live endpoint stores it for the worker
    spec: dict[str, Any] | None = None  # GenerationSpec.to_record(); None for embeddings
    response_model: str | None = None  # the adapter the line named as its model
    responses: dict[str, Any] | None = None  # a `/v1/responses` line's `JobRecord.responses`

    def to_json(self) -> str:
        data = {"custom_id": self.custom_id, "model": self.model, "request": self.request}
        if self.spec is not None:
            data["spec"] = self.spec
        if self.response_model is not None:
            data["response_model"] = self.response_model
        if self.responses is not None:
            data["responses"] = self.responses
        return json.dumps(data, ensure_ascii=False)


@dataclass
class InvalidLine:
    line: int
    custom_id: str | None
    code: str
    message: str


class LineError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def numbered_lines(content: bytes) -> Iterator[tuple[int, bytes]]:
    """Non-blank lines and their 1-based numbers; a leading BOM and CR line ends dropped."""
    if content.startswith(BOM):
        content = content[len(BOM) :]
    for number, raw in enumerate(content.split(b"\n"), start=1):
        raw = raw.removesuffix(b"\r")
        if raw.strip():
            yield number, raw


def validate_lines(
    content: bytes,
    endpoint: str,
    models: dict[str, dict[str, Any]],
    texts: ModelTexts | None = None,
    adapters: dict[str, str] | None = None,
) -> tuple[list[ValidLine], list[InvalidLine]]:
    """Every non-blank line, valid or not; `models` maps known model ids to their info,
    `texts` reads their tokenizers and templates (`api.flow.check_context`), `adapters`
    maps LoRA adapter names to their base models (`api.loras.adapters_of`)."""
    valid: list[ValidLine] = []
    invalid: list[InvalidLine] = []
    seen: set[str] = set()
    for number, raw in numbered_lines(content):
        custom_id = None
        try:
            data = _decode(raw)
            custom_id = _custom_id(data)
            if custom_id in seen:
                raise LineError(
                    "duplicate_custom_id",
                    f"custom_id {custom_id!r} was already used on an earlier line.",
                )
            seen.add(custom_id)
            req, responses = _request(data, endpoint)
            line = _checked_line(number, req, custom_id, models, texts, adapters or {})
            line.responses = responses
            valid.append(line)
        except LineError as exc:
            invalid.append(InvalidLine(number, custom_id, exc.code, exc.message))
    return valid, invalid


def _decode(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_LINE_BYTES:
        raise LineError(
            "line_too_long", f"The line is {len(raw)} bytes; the limit is {MAX_LINE_BYTES}."
        )
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        message = f"The line is not valid UTF-8 (byte {exc.start})."
        raise LineError("invalid_json_line", message) from None
    try:
        data = parse_json(raw)
    except APIError as exc:
        raise LineError("invalid_json_line", exc.message) from None
    if not isinstance(data, dict):
        raise LineError(
            "invalid_json_line", f"The line must be a JSON object, got {json_type(data)}."
        )
    return data


def _custom_id(data: dict[str, Any]) -> str:
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id.strip():
        raise LineError(
            "missing_custom_id", "custom_id is required and must be a non-empty string."
        )
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise LineError(
            "invalid_custom_id",
            f"custom_id must be at most {MAX_CUSTOM_ID_CHARS} characters, got {len(custom_id)}.",
        )
    return custom_id


def _request(data: dict[str, Any], endpoint: str) -> tuple[Any, dict[str, Any] | None]:
    """The line's request, parsed as its endpoint parses it, and a `/v1/responses` line's
    `JobRecord.responses`."""
    unknown = sorted(set(data) - set(LINE_FIELDS))
    if unknown:
        raise LineError("invalid_request", f"Unrecognized field in the line: {unknown[0]}")
    if data.get("method") != "POST":
        raise LineError("invalid_method", f"method must be 'POST', got {data.get('method')!r}.")
    if data.get("url") != endpoint:
        raise LineError(
            "mismatched_url",
            f"url must be the batch's endpoint {endpoint!r}, got {data.get('url')!r}.",
        )
    body = data.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "body must be a JSON object (the request body).")
    if body.get("stream") is True:
        raise LineError("invalid_request", "stream is not available in a batch.")
    try:
        if endpoint == RESPONSES:
            return _response_request(body)
        return parse_request(endpoint, body), None
    except APIError as exc:
        raise _line_error(exc) from None


def _response_request(body: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A Responses request as the chat request it translates to, as `POST /v1/responses`
    runs it (`api.responses.routes`), and what its record keeps: the Responses request and
    the response id its output line answers with."""
    req = parse_response_request(body)
    for name, why in (
        ("background", "every batch line already runs in the background"),
        ("previous_response_id", "a batch line cannot continue a stored response"),
    ):
        if getattr(req, name):
            raise LineError("invalid_request", f"{name} is not available in a batch: {why}.")
    response_id = new_response_id()
    translation = translate(req, response_id, [])
    stored = translation.stored.model_copy(update={"id": response_id, "store": False})
    return translation.chat, stored.encode()


def _checked_line(
    number: int,
    req: Any,
    custom_id: str,
    models: dict[str, dict[str, Any]],
    texts: ModelTexts | None,
    adapters: dict[str, str],
) -> ValidLine:
    """A parsed request checked against its model, as `api.flow.submit_request` checks it
    (its errors name the fields as `req.param_name` calls them)."""
    requested = req.model
    try:
        loras.apply(req, models, adapters)  # a model naming an adapter; unknown adapters
        info = models.get(req.model)
        if info is None:
            raise LineError("model_not_found", f"The model {req.model!r} does not exist.")
        spec = req.to_spec()
        check_context(req, spec, info, texts)
    except APIError as exc:
        raise _line_error(exc) from None
    record = None if spec is None else spec.to_record()
    named = requested if requested != req.model else None
    return ValidLine(number, custom_id, req.model, req.to_job_request(), record, named)


def _line_error(error: APIError) -> LineError:
    return LineError(error.code or "invalid_request", error.message)
