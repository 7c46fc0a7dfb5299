"""The `files` blueprint: OpenAI's Files API, for batch input and output files.

Only `purpose=batch` uploads are accepted (llmq stores no other kind). An upload is checked
as a whole here: UTF-8, at most `MAX_FILE_BYTES` (413), at most `MAX_BATCH_LINES` non-blank
lines, not empty (400). Its lines are validated one by one when a batch is created from it.
"""

from __future__ import annotations

import logging

import redis
from flask import Blueprint, Response, jsonify, request
from werkzeug.exceptions import RequestEntityTooLarge

from api.auth import caller_scope, require_api_key
from api.batches import store as batch_store
from api.batches.lines import numbered_lines
from api.bodies import FileDeleted, FileList
from api.body import UnsupportedMediaType
from api.config import redis_conn, replication
from api.errors import InvalidRequest, PayloadTooLarge
from api.paging import int_arg, list_page
from workers import keys
from workers.wire.batches import FILE_PURPOSE_BATCH
from workers.wire.broker import NotReplicated
from workers.wire.defaults import FILE_TTL_SECONDS, MAX_BATCH_LINES, MAX_FILE_BYTES

log = logging.getLogger(__name__)

bp = Blueprint("files", __name__, url_prefix="/v1/files")
bp.before_request(require_api_key)

MULTIPART_SLACK = 64 * 1024  # boundaries and the other form fields around the file
MIN_EXPIRES_SECONDS = 3600  # OpenAI's lower bound for expires_after[seconds]
MAX_FILENAME_CHARS = 255


@bp.post("")
def upload() -> Response:
    if request.mimetype != "multipart/form-data":
        raise UnsupportedMediaType(
            f"Content-Type must be multipart/form-data, got {request.mimetype or 'none'!r}."
        )
    request.max_content_length = MAX_FILE_BYTES + MULTIPART_SLACK
    try:
        form, files = request.form, request.files
    except RequestEntityTooLarge:
        raise _too_large() from None
    purpose = form.get("purpose")
    if purpose != FILE_PURPOSE_BATCH:
        raise InvalidRequest(
            f"purpose must be 'batch' (the only purpose llmq stores), got {purpose!r}.",
            param="purpose",
        )
    upload = files.get("file")
    if upload is None:
        raise InvalidRequest("file is required (a multipart/form-data file field).", param="file")
    data = upload.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise _too_large()
    _check_jsonl(data)
    filename = (upload.filename or "upload.jsonl")[:MAX_FILENAME_CHARS]
    ttl = _expires_after(form.get("expires_after[anchor]"), form.get("expires_after[seconds]"))
    conn, scope = redis_conn(), caller_scope()
    record = batch_store.create_file(conn, data, filename, purpose, ttl, scope)
    try:  # with Sentinels: answered once the file is on the replicas too
        replication().confirm(conn, keys.file(record.id))
    except NotReplicated:
        try:  # refused, so not kept: a retry uploads it again
            batch_store.delete_file(conn, record.id, scope)
        except redis.RedisError as exc:
            log.warning("file %s: could not delete it after a refusal: %s", record.id, exc)
        raise
    return jsonify(record.to_body().dump())


def _too_large() -> PayloadTooLarge:
    return PayloadTooLarge(
        f"The file is too large; the limit is {MAX_FILE_BYTES} bytes.", code="file_too_large"
    )


def _check_jsonl(data: bytes) -> None:
    """File-level rules; each line's own problems are reported per line later."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(
            f"The file is not valid UTF-8 (byte {exc.start}); batch files are JSONL in UTF-8.",
            param="file",
            code="invalid_file",
        ) from None
    count = 0
    for count, _ in enumerate(numbered_lines(data), start=1):
        if count > MAX_BATCH_LINES:
            raise InvalidRequest(
                f"The file has more than {MAX_BATCH_LINES} lines; split it into several batches.",
                param="file",
                code="too_many_lines",
            )
    if count == 0:
        raise InvalidRequest("The file has no lines.", param="file", code="empty_file")


def _expires_after(anchor: str | None, seconds: str | None) -> int:
    """OpenAI's optional expiry policy, within llmq's retention of `FILE_TTL_SECONDS`."""
    if anchor is None and seconds is None:
        return FILE_TTL_SECONDS
    if anchor != "created_at":
        raise InvalidRequest(
            f"expires_after[anchor] must be 'created_at', got {anchor!r}.",
            param="expires_after[anchor]",
        )
    try:
        value = int(seconds or "")
    except ValueError:
        value = -1
    if not MIN_EXPIRES_SECONDS <= value <= FILE_TTL_SECONDS:
        raise InvalidRequest(
            f"expires_after[seconds] must be an integer in [{MIN_EXPIRES_SECONDS}, "
            f"{FILE_TTL_SECONDS}], got {seconds!r}.",
            param="expires_after[seconds]",
        )
    return value


@bp.get("")
def list_files() -> Response:
    limit = int_arg("limit", 10_000, 1, batch_store.MAX_LIST_LIMIT)
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order must be 'asc' or 'desc', got {order!r}.", param="order")
    records, more = batch_store.list_files(
        redis_conn(),
        limit,
        request.args.get("after"),
        order == "asc",
        request.args.get("purpose"),
        caller_scope(),
    )
    return jsonify(list_page(FileList, [r.to_body() for r in records], more))


@bp.get("/<file_id>")
def get_file(file_id: str) -> Response:
    return jsonify(batch_store.get_file(redis_conn(), file_id, caller_scope()).to_body().dump())


@bp.get("/<file_id>/content")
def get_content(file_id: str) -> Response:
    data = batch_store.file_content(redis_conn(), file_id, caller_scope())
    return Response(data, mimetype="application/octet-stream")


@bp.delete("/<file_id>")
def delete_file(file_id: str) -> Response:
    batch_store.delete_file(redis_conn(), file_id, caller_scope())
    return jsonify(FileDeleted(id=file_id, object="file", deleted=True).dump())
