"""The batch driver: moves every offline batch on, from whichever worker holds its lock.

Why in the workers: a batch runs for hours and must not depend on any API process staying
alive. Every worker calls `BatchDriver.tick()` a couple of times a second; a short Redis
lock (`keys.BATCHES_LOCK`, extended after each batch it moves on) lets one of them work at
a time, and a worker killed mid-tick only leaves a lock that expires within `LOCK_MS`. Two
drivers at once (a tick that outlived its lock) are harmless, only wasteful: collecting is
idempotent, feeding is fenced by the cursor, and finalizing again writes the same files.
Each tick, for each active batch, oldest first:

1. past `expires_at`, the batch is wound down as `expired`;
2. `validating` becomes `in_progress`;
3. collect: each fed line whose job ended is written, once, to the batch's output or
   error hash under its line number (a script that ignores a line already there), then
   its job record and event stream are deleted;
4. feed: the next lines become jobs of kind `batch` (job id `keys.batch_job_id`), only
   while the model's batch queue holds fewer than `QUEUE_DEPTH` jobs, so a 50,000-line
   batch never floods Redis and new batches and interactive traffic are not starved. The
   cursor `fed` moves in the same transaction as the enqueues, so no line is fed twice;
5. a cancelled or expired batch instead flags its jobs to stop (queued ones are taken off
   their queue at once) and its unfed lines become error records;
6. once nothing is in flight: the output and error files are written and the batch ends.
A worker killed mid-job does not matter here: the job is resumed by another worker from
its event stream (`workers.recovery`), and collected when it ends.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import replace
from typing import Any

import redis
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from workers import keys
from workers.event_store import Events
from workers.wire.batch_output import error_line, output_line
from workers.wire.batches import (
    BATCH_CANCELLED,
    BATCH_CANCELLING,
    BATCH_COMPLETED,
    BATCH_EXPIRED,
    BATCH_FINALIZING,
    BATCH_IN_PROGRESS,
    BATCH_TERMINAL,
    BATCH_VALIDATING,
    FILE_PURPOSE_OUTPUT,
    BatchRecord,
    FileRecord,
)
from workers.wire.broker import BROKER_LOST
from workers.wire.defaults import CANCEL_FLAG_TTL_SECONDS, FILE_TTL_SECONDS, JOB_TTL_SECONDS
from workers.wire.errors import cancelled_error
from workers.wire.job import (
    CANCELLED,
    CHAT_COMPLETIONS,
    FINISHED,
    QUEUED,
    RESPONSES,
    TERMINAL_STATUSES,
    JobRecord,
)
from workers.wire.members import each_member
from workers.wire.responses_api import render, stored_request
from workers.wire.rq_job import write_queued_rq_job
from workers.wire.text import as_str
from workers.wire.wake import push_wake
from workers.wire.webhooks import queue_batch_event

log = logging.getLogger("llmq.batches")

TICK_SECONDS = 0.5  # how often each worker tries to run the driver
LOCK_MS = 5_000  # a driver that dies holding the lock delays the others this long at most
QUEUE_DEPTH = 256  # batch jobs kept waiting per model's batch queue (feeds <= 512 lines/s)
FEED_CHUNK = 64  # lines enqueued per transaction
ENDINGS = {BATCH_CANCELLED: "batch_cancelled", BATCH_EXPIRED: "batch_expired"}
ENDING_MESSAGES = {
    BATCH_CANCELLED: "The batch was cancelled before this request finished.",
    BATCH_EXPIRED: "This request could not be executed before the completion window expired.",
}

# KEYS: batch, output hash, errors hash, inflight set. ARGV: line, "output" | "errors",
# JSONL line, input tokens, cached tokens, output tokens, reasoning tokens (of the output
# ones). A line already answered is left
# alone (its counters too): whatever happens, every line is answered exactly once.
_COLLECT = """
local answered = redis.call('HEXISTS', KEYS[2], ARGV[1]) + redis.call('HEXISTS', KEYS[3], ARGV[1])
if answered == 0 then
  if ARGV[2] == 'output' then
    redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
    redis.call('HINCRBY', KEYS[1], 'completed', 1)
  else
    redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
    redis.call('HINCRBY', KEYS[1], 'failed', 1)
  end
  redis.call('HINCRBY', KEYS[1], 'input_tokens', ARGV[4])
  redis.call('HINCRBY', KEYS[1], 'cached_tokens', ARGV[5])
  redis.call('HINCRBY', KEYS[1], 'output_tokens', ARGV[6])
  redis.call('HINCRBY', KEYS[1], 'reasoning_tokens', ARGV[7])
end
redis.call('SREM', KEYS[4], ARGV[1])
return 1
"""

# KEYS: batch. ARGV: expected status, then field/value pairs. 1 if the status matched.
_TRANSITION = """
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
return 1
"""

# KEYS: lock. ARGV: owner. Deletes the lock only if it is still ours.
_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS: lock. ARGV: owner, TTL (ms). Extends the lock only if it is still ours.
_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""


class BatchDriver:
    def __init__(
        self,
        conn: redis.Redis,
        owner: str,
        events: Events,
        queue_depth: int = QUEUE_DEPTH,
    ) -> None:
        self.conn = conn
        self.events = events  # where the jobs' streams are
        self.owner = owner
        self.queue_depth = queue_depth

    def tick(self) -> None:
        """Move every active batch on, if no other worker is doing it right now."""
        if not self.conn.scard(keys.BATCHES_ACTIVE):
            return
        if not self.conn.set(keys.BATCHES_LOCK, self.owner, nx=True, px=LOCK_MS):
            return
        try:
            for record in self._active():
                try:
                    self.advance(record)
                except BROKER_LOST:
                    raise
                except Exception:  # one broken batch must not stall the others or the worker
                    log.exception("batch %s: the driver failed on it; retrying later", record.id)
                self.conn.eval(_EXTEND, 1, keys.BATCHES_LOCK, self.owner, LOCK_MS)
        finally:
            self.conn.eval(_UNLOCK, 1, keys.BATCHES_LOCK, self.owner)

    def _active(self) -> list[BatchRecord]:
        records = []
        active = each_member(self.conn, keys.BATCHES_ACTIVE, lambda p, i: p.hgetall(keys.batch(i)))
        for batch_id, raw in active:
            if not raw:
                self.conn.srem(keys.BATCHES_ACTIVE, batch_id)  # expired or deleted
                continue
            records.append(BatchRecord.from_hash(raw))
        return sorted(records, key=lambda r: r.created_at)

    def advance(self, rec: BatchRecord) -> None:
        """One step of one batch (see the module docstring)."""
        if rec.status in BATCH_TERMINAL:
            self.conn.srem(keys.BATCHES_ACTIVE, rec.id)
            return
        now = time.time()
        if rec.ending is None and rec.status != BATCH_FINALIZING and now >= rec.expires_at:
            rec.ending = BATCH_EXPIRED
            self.conn.hset(keys.batch(rec.id), "ending", BATCH_EXPIRED)
            log.info("batch %s: its completion window passed; expiring it", rec.id)
        if rec.status == BATCH_VALIDATING and self._move(
            rec, BATCH_VALIDATING, BATCH_IN_PROGRESS, in_progress_at=now
        ):
            log.info("batch %s: in progress (%d lines to run)", rec.id, rec.valid)
        self._collect(rec)
        ending = self._ending(rec)
        if ending is not None:
            self._stop(rec)
        elif rec.status == BATCH_IN_PROGRESS:
            self._feed(rec)
        if self.conn.scard(keys.batch_inflight(rec.id)) == 0 and (
            ending is not None or rec.fed >= rec.valid
        ):
            self._finalize(rec, ending)

    def _ending(self, rec: BatchRecord) -> str | None:
        if rec.status == BATCH_CANCELLING:
            return BATCH_CANCELLED
        return BATCH_EXPIRED if rec.ending == BATCH_EXPIRED else None

    def _move(self, rec: BatchRecord, expected: str, status: str, **times: float) -> bool:
        fields: list[Any] = ["status", status]
        for name, value in times.items():
            fields += [name, str(value)]
        if not self.conn.eval(_TRANSITION, 1, keys.batch(rec.id), expected, *fields):
            fresh = self.conn.hget(keys.batch(rec.id), "status")
            rec.status = as_str(fresh) if fresh is not None else rec.status
            return False
        rec.status = status
        for name, value in times.items():
            setattr(rec, name, value)
        return True

    # ------------------------------------------------------------------ collecting

    def _collect(self, rec: BatchRecord) -> None:
        lines = sorted(int(m) for m in self.conn.smembers(keys.batch_inflight(rec.id)))
        if not lines:
            return
        job_ids = [keys.batch_job_id(rec.id, line) for line in lines]
        responses = rec.endpoint == RESPONSES
        with self.conn.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                if responses:  # the whole record: its Response is rendered from it
                    pipe.hgetall(keys.job(job_id))
                else:
                    pipe.hmget(keys.job(job_id), "status", "result", "error")
            pipe.hmget(keys.batch_requests(rec.id), lines)
            *states, raw_requests = pipe.execute()
        if responses:
            states = [_response_state(h) for h in states]
        ending = self._ending(rec)
        with self.conn.pipeline() as pipe:
            for line, job_id, state, raw in zip(lines, job_ids, states, raw_requests, strict=True):
                status = as_str(state[0]) if state[0] is not None else None
                if status is not None and status not in TERMINAL_STATUSES:
                    continue
                custom_id = json.loads(raw)["custom_id"] if raw is not None else None
                args = _answer(rec.id, line, custom_id, job_id, status, state[1:], ending)
                self._record(pipe, rec, line, *args)
                pipe.delete(keys.job(job_id), keys.job_cancel(job_id))
                self.events.delete_stream(pipe, job_id)
            pipe.expire(keys.batch_output(rec.id), _batch_ttl(rec))
            pipe.expire(keys.batch_errors(rec.id), _batch_ttl(rec))
            pipe.execute()

    def _record(
        self, pipe: Any, rec: BatchRecord, line: int, target: str, text: str, usage: tuple
    ) -> None:
        batch_keys = [
            keys.batch(rec.id),
            keys.batch_output(rec.id),
            keys.batch_errors(rec.id),
            keys.batch_inflight(rec.id),
        ]
        pipe.eval(_COLLECT, len(batch_keys), *batch_keys, line, target, text, *usage)

    # ------------------------------------------------------------------ feeding

    def _feed(self, rec: BatchRecord) -> None:
        room: dict[str, int] = {}
        while rec.fed < rec.valid:
            end = rec.fed + FEED_CHUNK - 1
            lines = [int(x) for x in self.conn.lrange(keys.batch_lines(rec.id), rec.fed, end)]
            raws = self.conn.hmget(keys.batch_requests(rec.id), lines) if lines else []
            chunk: list[tuple[int, dict[str, Any]]] = []
            for line, raw in zip(lines, raws, strict=True):
                item = json.loads(raw) if raw is not None else None
                model = item["model"] if item else ""
                if model not in room:
                    depth = _waiting(self.conn, _queue(self.conn, model).name) if model else 0
                    room[model] = self.queue_depth - depth
                if room[model] <= 0:
                    break
                room[model] -= 1
                chunk.append((line, item))
            if not chunk or not self._enqueue(rec, chunk):
                return

    def _enqueue(self, rec: BatchRecord, chunk: list[tuple[int, dict[str, Any] | None]]) -> bool:
        """Enqueue a chunk of lines and move the cursor, atomically; False if the batch
        changed meanwhile (cancelled, or another driver fed it): the next tick sees why."""
        with self.conn.pipeline() as pipe:
            try:
                pipe.watch(keys.batch(rec.id))
                fed = int(pipe.hget(keys.batch(rec.id), "fed") or 0)
                status = as_str(pipe.hget(keys.batch(rec.id), "status") or b"")
                if fed != rec.fed or status != BATCH_IN_PROGRESS:
                    pipe.unwatch()
                    return False
                pipe.multi()
                missing = []
                for line, item in chunk:
                    if item is None:
                        missing.append(line)
                        continue
                    self._enqueue_line(pipe, rec, line, item)
                    pipe.sadd(keys.batch_inflight(rec.id), line)
                for model in {item["model"] for _, item in chunk if item is not None}:
                    push_wake(pipe, keys.queue_wake(keys.queue_name(model, keys.BATCH)))
                for line in missing:  # its request expired with the batch's keys
                    text = error_line(rec.id, line, None, "request_lost", "The request expired.")
                    self._record(pipe, rec, line, "errors", text, (0, 0, 0, 0))
                pipe.expire(keys.batch_inflight(rec.id), _batch_ttl(rec))
                pipe.hset(keys.batch(rec.id), "fed", fed + len(chunk))
                pipe.hincrby(keys.METRIC_JOBS, QUEUED, len(chunk) - len(missing))
                pipe.execute()
            except redis.WatchError:
                return False
        rec.fed += len(chunk)
        return True

    def _enqueue_line(self, pipe: Any, rec: BatchRecord, line: int, item: dict[str, Any]) -> None:
        job_id = keys.batch_job_id(rec.id, line)
        priority = int(item["request"].get("priority", 0))
        record = JobRecord(
            id=job_id,
            endpoint=CHAT_COMPLETIONS if rec.endpoint == RESPONSES else rec.endpoint,
            model=item["model"],
            request=item["request"],
            spec=item.get("spec"),
            response_model=item.get("response_model"),
            kind=keys.BATCH,
            priority=priority,
            batch_id=rec.id,
            owner=rec.owner,
            responses=item.get("responses"),
        )
        pipe.hset(keys.job(job_id), mapping=record.to_hash())
        pipe.expire(keys.job(job_id), JOB_TTL_SECONDS)
        shared = _queue(self.conn, record.model)
        write_queued_rq_job(pipe, self.conn, job_id, shared.name)
        waits_on = keys.level_queue_name(shared.name, priority)
        pipe.rpush(Queue.redis_queue_namespace_prefix + waits_on, job_id)
        pipe.sadd(Queue.redis_queues_keys, Queue.redis_queue_namespace_prefix + waits_on)
        if priority:
            pipe.zadd(keys.queue_levels(shared.name), {str(priority): priority})

    # ------------------------------------------------------------------ stopping

    def _stop(self, rec: BatchRecord) -> None:
        """Flag every job still in flight; one still queued is taken off its queue and
        cancelled here (no worker may be serving its model)."""
        lines = [int(m) for m in self.conn.smembers(keys.batch_inflight(rec.id))]
        for line in lines:
            job_id = keys.batch_job_id(rec.id, line)
            status, model, priority = self.conn.hmget(
                keys.job(job_id), "status", "model", "priority"
            )
            if status is None or as_str(status) in TERMINAL_STATUSES:
                continue
            self.conn.set(keys.job_cancel(job_id), "1", ex=CANCEL_FLAG_TTL_SECONDS)
            level = keys.level_queue_name(_queue(self.conn, as_str(model)).name, int(priority or 0))
            waits_on = Queue.redis_queue_namespace_prefix + level
            if as_str(status) == QUEUED and self.conn.lrem(waits_on, 1, job_id):
                body = cancelled_error()
                fields = {
                    "status": CANCELLED,
                    "error": json.dumps(body),
                    "finished_at": time.time(),
                }
                self.conn.hset(keys.job(job_id), mapping=fields)
                try:
                    Job.fetch(job_id, connection=self.conn, serializer=JSONSerializer).cancel()
                except (NoSuchJobError, InvalidJobOperation):
                    pass
        if lines:
            self._collect(rec)

    # ------------------------------------------------------------------ finalizing

    def _finalize(self, rec: BatchRecord, ending: str | None) -> None:
        """Write the output and error files and end the batch, in one transaction; a driver
        that dies half-way leaves the batch as it was, and the next tick does it again."""
        now = time.time()
        if ending is None and rec.status == BATCH_IN_PROGRESS:
            if not self._move(rec, BATCH_IN_PROGRESS, BATCH_FINALIZING, finalizing_at=now):
                return  # cancelled meanwhile: the next tick ends it as cancelled
        if ending is not None:
            self._write_off_unfed(rec, ending)
        output = self._joined_lines(keys.batch_output(rec.id))
        errors = self._joined_lines(keys.batch_errors(rec.id))
        final = ending or BATCH_COMPLETED
        fields: dict[str, str] = {"status": final, f"{final}_at": str(now)}
        with self.conn.pipeline() as pipe:
            for kind, text in (("output", output), ("error", errors)):
                if text:
                    file_id = _file_id(rec.id, kind)
                    name = f"{rec.id}_{kind}.jsonl"
                    self._write_file(pipe, file_id, name, text, now, rec.owner)
                    fields[f"{kind}_file_id"] = file_id
            pipe.hset(keys.batch(rec.id), mapping=fields)
            pipe.expire(keys.batch(rec.id), FILE_TTL_SECONDS)
            pipe.delete(
                keys.batch_lines(rec.id),
                keys.batch_requests(rec.id),
                keys.batch_inflight(rec.id),
                keys.batch_output(rec.id),
                keys.batch_errors(rec.id),
            )
            pipe.srem(keys.BATCHES_ACTIVE, rec.id)
            queue_batch_event(pipe, rec.id, final)  # the webhook outbox, in the same MULTI
            pipe.execute()
        rec.status = final
        log.info(
            "batch %s: %s (%d output lines, %d error lines)",
            rec.id,
            final,
            output.count(b"\n"),
            errors.count(b"\n"),
        )

    def _write_off_unfed(self, rec: BatchRecord, ending: str) -> None:
        lines = [int(x) for x in self.conn.lrange(keys.batch_lines(rec.id), rec.fed, -1)]
        for start in range(0, len(lines), 500):
            chunk = lines[start : start + 500]
            raws = self.conn.hmget(keys.batch_requests(rec.id), chunk)
            with self.conn.pipeline() as pipe:
                for line, raw in zip(chunk, raws, strict=True):
                    custom_id = json.loads(raw)["custom_id"] if raw is not None else None
                    text = error_line(
                        rec.id, line, custom_id, ENDINGS[ending], ENDING_MESSAGES[ending]
                    )
                    self._record(pipe, rec, line, "errors", text, (0, 0, 0, 0))
                pipe.execute()

    def _joined_lines(self, key: str) -> bytes:
        """A hash of line number -> JSONL line as one file's bytes, in line order."""
        entries = sorted((int(k), v) for k, v in self.conn.hgetall(key).items())
        return b"".join(v + b"\n" for _, v in entries)

    def _write_file(
        self, pipe: Any, file_id: str, name: str, text: bytes, now: float, owner: str | None
    ) -> None:
        expires = now + FILE_TTL_SECONDS
        record = FileRecord(file_id, len(text), name, FILE_PURPOSE_OUTPUT, now, expires, owner)
        pipe.set(keys.file_content(file_id), text, ex=FILE_TTL_SECONDS)
        pipe.hset(keys.file(file_id), mapping=record.to_hash())
        pipe.expire(keys.file(file_id), FILE_TTL_SECONDS)
        pipe.zadd(keys.FILES, {file_id: now})


def _response_state(raw: dict[bytes, bytes]) -> list[Any]:
    """A Responses line's job as `_answer` reads a chat line's (status, result, error), its
    result the Response object rendered from the record (`wire.responses_api.render`) under
    the response id the line was given."""
    if not raw:
        return [None, None, None]
    record = JobRecord.from_hash(raw)
    result = None
    if record.status == FINISHED and record.result is not None:
        response_id = stored_request(record).id or record.id
        result = json.dumps(render(replace(record, id=response_id)), ensure_ascii=False)
    return [record.status, result, raw.get(b"error")]


def _answer(
    batch_id: str,
    line: int,
    custom_id: str | None,
    job_id: str,
    status: str | None,
    fields: list[bytes | str | None],
    ending: str | None,
) -> tuple[str, str, tuple[int, int, int, int]]:
    """(target hash, JSONL line, token usage) for a line whose job ended (or vanished)."""
    raw_result, raw_error = fields
    if status is None:
        text = error_line(batch_id, line, custom_id, "job_lost", "The request's job expired.")
        return "errors", text, (0, 0, 0, 0)
    if status == FINISHED and raw_result is not None:
        body = json.loads(raw_result)
        tokens = _tokens(body.get("usage") or {})
        return "output", output_line(batch_id, line, custom_id, job_id, body), tokens
    error = json.loads(raw_error) if raw_error is not None else {}
    detail = error.get("error") or {}
    if status == CANCELLED and ending is not None:
        text = error_line(batch_id, line, custom_id, ENDINGS[ending], ENDING_MESSAGES[ending])
        return "errors", text, (0, 0, 0, 0)
    response = {
        "status_code": error.get("status", 500),
        "request_id": job_id,
        "body": {"error": detail},
    }
    code = detail.get("code") or detail.get("type") or status
    message = detail.get("message") or f"The request {status}."
    return "errors", error_line(batch_id, line, custom_id, code, message, response), (0, 0, 0, 0)


def _tokens(usage: dict[str, Any]) -> tuple[int, int, int, int]:
    """(prompt, cached, completion, reasoning) tokens of a chat or completion body's usage
    (`completion_tokens_details.reasoning_tokens`), or of a Response's (`input_tokens`,
    `output_tokens`, `output_tokens_details.reasoning_tokens`)."""
    if "input_tokens" in usage:
        cached = (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
        reasoning = (usage.get("output_tokens_details") or {}).get("reasoning_tokens", 0)
        return usage["input_tokens"], cached or 0, usage.get("output_tokens", 0), reasoning or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return prompt, cached or 0, completion, reasoning or 0


def _queue(conn: redis.Redis, model: str) -> Queue:
    return Queue(keys.queue_name(model, keys.BATCH), connection=conn, serializer=JSONSerializer)


def _waiting(conn: redis.Redis, name: str) -> int:
    """Jobs waiting on the shared queue `name` at every priority level."""
    levels = [int(float(p)) for p in conn.zrange(keys.queue_levels(name), 0, -1)]
    names = [name, *(keys.level_queue_name(name, p) for p in levels if p != 0)]
    with conn.pipeline(transaction=False) as pipe:
        for level in names:
            pipe.llen(Queue.redis_queue_namespace_prefix + level)
        return sum(pipe.execute())


def _file_id(batch_id: str, kind: str) -> str:
    """Deterministic, so a finalize that is done again rewrites the same files."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:24]


def _batch_ttl(rec: BatchRecord) -> int:
    return max(60, int(rec.expires_at + FILE_TTL_SECONDS - time.time()))
