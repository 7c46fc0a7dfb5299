"""The `batches` blueprint: OpenAI's Batch API (create, retrieve, list, cancel).

Creating a batch validates every line of its input file here, in the request (a few
seconds for 50,000 lines), and stores the batch in one transaction: an API process that
dies half-way leaves no half-made batch. From then on the batch belongs to the workers'
batch driver (`workers.batches`), so it does not depend on any API process staying alive.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import redis
from flask import Blueprint, Response, current_app, jsonify, request

from api import rate_limits, store
from api.auth import caller_scope, require_api_key
from api.batches import store as batch_store
from api.batches.lines import validate_lines
from api.bodies import BatchList
from api.body import json_object
from api.config import redis_conn, replication
from api.errors import APIError, InvalidRequest
from api.loras import adapters_of
from api.paging import int_arg, list_page
from workers import keys
from workers.wire.batches import FILE_PURPOSE_BATCH
from workers.wire.broker import NotReplicated
from workers.wire.defaults import MAX_COMPLETION_WINDOW_SECONDS
from workers.wire.job import BATCH_ENDPOINTS

log = logging.getLogger(__name__)

bp = Blueprint("batches", __name__, url_prefix="/v1/batches")
bp.before_request(require_api_key)

CREATE_FIELDS = ("input_file_id", "endpoint", "completion_window", "metadata")
WINDOW = re.compile(r"^([1-9][0-9]{0,5})([smh])$")
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600}
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


@bp.post("")
def create_batch() -> Response:
    body = json_object({*CREATE_FIELDS, "output_expires_after"})
    endpoint = body.get("endpoint")
    if endpoint not in BATCH_ENDPOINTS:
        raise InvalidRequest(
            f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {endpoint!r}.",
            param="endpoint",
        )
    window = parse_window(body.get("completion_window"))
    metadata = _metadata(body.get("metadata"))
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str):
        raise InvalidRequest("input_file_id is required (a file id).", param="input_file_id")
    conn, scope = redis_conn(), caller_scope()
    record = batch_store.get_file(conn, file_id, scope)
    if record.purpose != FILE_PURPOSE_BATCH:
        raise InvalidRequest(
            f"input_file_id must be a file with purpose 'batch', got {record.purpose!r}.",
            param="input_file_id",
        )
    # one request and no tokens, before the lines are read: its lines do not count against
    # the per-minute limits (api.rate_limits)
    admission = rate_limits.admit()
    try:
        content = batch_store.file_content(conn, file_id, scope)
        texts = current_app.extensions.get("model_texts")
        models = _models(conn)
        valid, invalid = validate_lines(content, endpoint, models, texts, adapters_of(conn))
        errors = None
        if not valid and not invalid:
            errors = [_file_error("empty_file", "The input file has no requests.")]
        batch = batch_store.create_batch(
            conn, endpoint, file_id, window, metadata, valid, invalid, errors, owner=scope
        )
        _acknowledge(conn, batch.id, scope)
    except Exception:
        rate_limits.give_back(admission, requests=True)
        raise
    return jsonify(batch.to_body().dump())


def _acknowledge(conn: Any, batch_id: str, scope: str | None) -> None:
    """With Sentinels, the batch is answered once it is on the replicas too; refused, it is
    cancelled, so that a retry does not run its lines twice."""
    try:
        replication().confirm(conn, keys.batch(batch_id))
    except NotReplicated:
        try:
            batch_store.cancel_batch(conn, batch_id, scope)
        except (redis.RedisError, APIError) as exc:
            log.warning("batch %s: could not cancel it after a refusal: %s", batch_id, exc)
        raise


def parse_window(value: Any) -> tuple[str, int]:
    """`completion_window` as (text, seconds): OpenAI's "24h", or any shorter N s|m|h."""
    match = WINDOW.match(value) if isinstance(value, str) else None
    seconds = int(match.group(1)) * UNIT_SECONDS[match.group(2)] if match else 0
    if not match or seconds > MAX_COMPLETION_WINDOW_SECONDS:
        raise InvalidRequest(
            f"completion_window must be '24h' (or a shorter duration such as '30m'), "
            f"got {value!r}.",
            param="completion_window",
        )
    return value, seconds


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    ok = isinstance(value, dict) and len(value) <= MAX_METADATA_PAIRS
    ok = ok and all(
        isinstance(k, str)
        and isinstance(v, str)
        and len(k) <= MAX_METADATA_KEY
        and len(v) <= MAX_METADATA_VALUE
        for k, v in value.items()
    )
    if not ok:
        raise InvalidRequest(
            f"metadata must be an object of at most {MAX_METADATA_PAIRS} string pairs "
            f"(keys up to {MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE}).",
            param="metadata",
        )
    return value


def _models(conn: Any) -> dict[str, dict[str, Any]]:
    """Models a line may name: those workers published, and any a live worker serves."""
    models = store.known_models(conn)
    for model in store.served_models(store.live_workers(conn)):
        models.setdefault(model, {})
    return models


def _file_error(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message, "param": "input_file_id", "line": None}


@bp.get("")
def list_batches() -> Response:
    limit = int_arg("limit", 20, 1, 100)
    after = request.args.get("after")
    records, more = batch_store.list_batches(redis_conn(), limit, after, caller_scope())
    return jsonify(list_page(BatchList, [r.to_body() for r in records], more))


@bp.get("/<batch_id>")
def get_batch(batch_id: str) -> Response:
    record = batch_store.get_batch(redis_conn(), batch_id, caller_scope())
    return jsonify(record.to_body().dump())


@bp.post("/<batch_id>/cancel")
def cancel_batch(batch_id: str) -> Response:
    record = batch_store.cancel_batch(redis_conn(), batch_id, caller_scope())
    return jsonify(record.to_body().dump())
