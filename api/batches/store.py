"""Files and batches in Redis, as the API reads and writes them.

Files live in Redis (not on a local disk) so that every API process and every worker can
reach them: an upload answered by one gunicorn process is read by another when the batch
is created, and the worker that finalizes a batch writes its output file where any API
process can serve it. Every key that holds prompt or output text has a TTL
(`FILE_TTL_SECONDS` for files; the completion window plus that for a batch's lines).

Files and batches carry their creator's `owner` digest (`api.auth.owner_of`); each lookup
takes the caller's `scope` and treats another owner's object as missing (404). A batch's
jobs and output files inherit its owner.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis

from api.auth import visible
from api.batches.lines import InvalidLine, ValidLine
from api.errors import BatchNotFound, Conflict, ExpiredOrMissing, FileNotFound
from api.paging import cursor_page
from workers import keys
from workers.wire.batch_output import error_line
from workers.wire.batches import (
    BATCH_CANCELLING,
    BATCH_FAILED,
    BATCH_IN_PROGRESS,
    BATCH_VALIDATING,
    BatchRecord,
    FileRecord,
)
from workers.wire.defaults import FILE_TTL_SECONDS
from workers.wire.webhooks import queue_batch_event

log = logging.getLogger(__name__)

MAX_LIST_LIMIT = 10_000


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- files


def create_file(
    conn: redis.Redis,
    data: bytes,
    filename: str,
    purpose: str,
    ttl: int = FILE_TTL_SECONDS,
    owner: str | None = None,
) -> FileRecord:
    now = time.time()
    record = FileRecord(new_file_id(), len(data), filename, purpose, now, now + ttl, owner)
    with conn.pipeline() as pipe:
        pipe.set(keys.file_content(record.id), data, ex=ttl)
        pipe.hset(keys.file(record.id), mapping=record.to_hash())
        pipe.expire(keys.file(record.id), ttl)
        pipe.zadd(keys.FILES, {record.id: now})
        pipe.execute()
    log.info("file %s stored: %d bytes, purpose %s", record.id, record.bytes, purpose)
    return record


def get_file(conn: redis.Redis, file_id: str, scope: str | None = None) -> FileRecord:
    return _owned(conn, file_id, scope, FileRecord, keys.file, keys.is_valid_file_id, FileNotFound)


_Record = TypeVar("_Record", FileRecord, BatchRecord)


def _owned(
    conn: redis.Redis,
    ident: str,
    scope: str | None,
    kind: type[_Record],
    key: Callable[[str], str],
    valid: Callable[[str], bool],
    missing: type[ExpiredOrMissing],
) -> _Record:
    """The record `ident` of `kind` if `scope` may see it; else `missing`: one 404 for an id
    that is malformed, never existed, expired, or belongs to another API key."""
    raw = conn.hgetall(key(ident)) if valid(ident) else {}
    record = kind.from_hash(raw) if raw else None
    if record is None or not visible(record.owner, scope):
        raise missing(ident)
    return record


def file_content(conn: redis.Redis, file_id: str, scope: str | None = None) -> bytes:
    get_file(conn, file_id, scope)
    data = conn.get(keys.file_content(file_id))
    if data is None:
        raise FileNotFound(file_id)
    return data


def delete_file(conn: redis.Redis, file_id: str, scope: str | None = None) -> None:
    get_file(conn, file_id, scope)
    with conn.pipeline() as pipe:
        pipe.delete(keys.file(file_id), keys.file_content(file_id))
        pipe.zrem(keys.FILES, file_id)
        pipe.execute()
    log.info("file %s deleted", file_id)


def list_files(
    conn: redis.Redis,
    limit: int,
    after: str | None,
    ascending: bool,
    purpose: str | None,
    scope: str | None = None,
) -> tuple[list[FileRecord], bool]:
    """A page of the caller's files (newest first unless `ascending`), whether more follow."""

    def keep(record: FileRecord) -> bool:
        return (purpose is None or record.purpose == purpose) and visible(record.owner, scope)

    return cursor_page(
        conn, keys.FILES, keys.file, FileRecord.from_hash, keep, limit, after, ascending
    )


# ---------------------------------------------------------------- batches


def create_batch(
    conn: redis.Redis,
    endpoint: str,
    input_file_id: str,
    window: tuple[str, int],
    metadata: dict[str, str] | None,
    valid: Sequence[ValidLine],
    invalid: Sequence[InvalidLine],
    errors: list[dict[str, Any]] | None = None,
    owner: str | None = None,
) -> BatchRecord:
    """Store a validated batch in one transaction: its record, its valid lines (for the
    batch driver to feed) and the error records of its invalid lines. `errors` (file-level
    problems) make it a failed batch that never runs."""
    now = time.time()
    text, seconds = window
    record = BatchRecord(
        id=new_batch_id(),
        endpoint=endpoint,
        input_file_id=input_file_id,
        completion_window=text,
        expires_at=now + seconds,
        created_at=now,
        model=valid[0].model if valid else None,
        total=len(valid) + len(invalid),
        failed=len(invalid),
        valid=len(valid),
        metadata=metadata,
        owner=owner,
    )
    if errors:
        record.status, record.failed_at, record.errors = BATCH_FAILED, now, errors
        record.total = record.failed = record.valid = 0
    ttl = seconds + FILE_TTL_SECONDS
    bid = record.id
    with conn.pipeline() as pipe:
        pipe.hset(keys.batch(bid), mapping=record.to_hash())
        pipe.expire(keys.batch(bid), ttl)
        pipe.zadd(keys.BATCHES, {bid: now})
        if errors:  # it ends here: the webhook outbox, in the same MULTI
            queue_batch_event(pipe, bid, BATCH_FAILED)
        if not errors:
            if valid:
                pipe.rpush(keys.batch_lines(bid), *[v.line for v in valid])
                pipe.hset(keys.batch_requests(bid), mapping={v.line: v.to_json() for v in valid})
            if invalid:
                lines = {
                    bad.line: error_line(bid, bad.line, bad.custom_id, bad.code, bad.message)
                    for bad in invalid
                }
                pipe.hset(keys.batch_errors(bid), mapping=lines)
            for key in (keys.batch_lines(bid), keys.batch_requests(bid), keys.batch_errors(bid)):
                pipe.expire(key, ttl)
            pipe.sadd(keys.BATCHES_ACTIVE, bid)
        pipe.execute()
    log.info(
        "batch %s created: endpoint %s, %d lines valid, %d invalid, window %s",
        bid,
        endpoint,
        len(valid),
        len(invalid),
        text,
    )
    return record


def get_batch(conn: redis.Redis, batch_id: str, scope: str | None = None) -> BatchRecord:
    valid = keys.is_valid_batch_id
    return _owned(conn, batch_id, scope, BatchRecord, keys.batch, valid, BatchNotFound)


def cancel_batch(conn: redis.Redis, batch_id: str, scope: str | None = None) -> BatchRecord:
    """Mark the batch cancelling; the batch driver stops its jobs and finalizes it."""
    get_batch(conn, batch_id, scope)
    with conn.pipeline() as pipe:
        while True:
            try:
                pipe.watch(keys.batch(batch_id))
                record = BatchRecord.from_hash(pipe.hgetall(keys.batch(batch_id)))
                if record.status == BATCH_CANCELLING:
                    pipe.unwatch()
                    return record
                if record.status not in (BATCH_VALIDATING, BATCH_IN_PROGRESS):
                    pipe.unwatch()
                    raise Conflict(
                        f"Cannot cancel a batch with status {record.status!r}.",
                        code="batch_not_cancellable",
                    )
                record.status, record.cancelling_at = BATCH_CANCELLING, time.time()
                pipe.multi()
                pipe.hset(
                    keys.batch(batch_id),
                    mapping={"status": record.status, "cancelling_at": str(record.cancelling_at)},
                )
                pipe.sadd(keys.BATCHES_ACTIVE, batch_id)
                pipe.execute()
                log.info("batch %s: cancelling", batch_id)
                return record
            except redis.WatchError:
                continue


def list_batches(
    conn: redis.Redis, limit: int, after: str | None, scope: str | None = None
) -> tuple[list[BatchRecord], bool]:
    """A page of the caller's batches (newest first) and whether more follow."""

    def keep(record: BatchRecord) -> bool:
        return visible(record.owner, scope)

    return cursor_page(
        conn, keys.BATCHES, keys.batch, BatchRecord.from_hash, keep, limit, after, False
    )
