"""The API's view of Redis: workers and models, job records, enqueueing and cancelling.

Every key comes from `workers.keys`; every record and event from `workers.wire`. The API
keeps no per-job state in memory, so any API process can answer for any job.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis
from flask import current_app, has_app_context
from rq import Queue
from rq.exceptions import InvalidJobOperation, NoSuchJobError
from rq.job import Job
from rq.serializers import JSONSerializer

from api.auth import visible
from api.errors import Conflict, JobNotFound, ModelNotFound, NoWorker, QueueFull
from api.gate import GateArgs, GateKeys, gate_submission
from api.paging import cursor_page
from workers import keys
from workers.wire import rate_limit
from workers.wire.broker import NotReplicated, Replication
from workers.wire.defaults import (
    AFFINITY_MAX_QUEUED,
    CANCEL_FLAG_TTL_SECONDS,
    JOB_TTL_SECONDS,
)
from workers.wire.errors import cancelled_error
from workers.wire.events import write_ending
from workers.wire.job import CANCELLED, QUEUED, TERMINAL_STATUSES, JobRecord
from workers.wire.members import each_member
from workers.wire.prefix import prefix_digest
from workers.wire.queues import llmq_queue_names
from workers.wire.rq_job import write_queued_rq_job
from workers.wire.text import as_str
from workers.wire.worker_info import WorkerInfo

log = logging.getLogger(__name__)

IDEMPOTENCY_WAIT_SECONDS = 3.0  # how long a repeat waits for the first submit to finish


def new_job_id() -> str:
    return uuid.uuid4().hex


def rq_queue(conn: redis.Redis, model: str, kind: str = keys.INTERACTIVE) -> Queue:
    return Queue(keys.queue_name(model, kind), connection=conn, serializer=JSONSerializer)


# ---------------------------------------------------------------- workers and models


def all_workers(conn: redis.Redis) -> list[WorkerInfo]:
    """Every registered worker whose hash still exists (alive or stale)."""
    hashes = each_member(conn, keys.WORKERS, lambda p, n: p.hgetall(keys.worker(n)))
    workers = []
    for name, raw in sorted(hashes, key=lambda pair: pair[0]):
        if not raw:
            continue
        try:
            workers.append(WorkerInfo.from_hash(raw))
        except (KeyError, ValueError) as exc:
            log.warning("ignoring malformed worker hash %s: %s", name, exc)
    return workers


def live_workers(conn: redis.Redis) -> list[WorkerInfo]:
    now = time.time()
    return [w for w in all_workers(conn) if w.is_alive(now)]


def known_models(conn: redis.Redis) -> dict[str, dict[str, Any]]:
    """Models published by workers in `keys.MODELS` (id -> info such as `context_length`)."""
    models: dict[str, dict[str, Any]] = {}
    for model, raw in conn.hgetall(keys.MODELS).items():
        try:
            info = json.loads(raw)
        except ValueError:
            info = {}
        models[as_str(model)] = info if isinstance(info, dict) else {}
    return models


def served_models(workers: list[WorkerInfo]) -> set[str]:
    return {m for w in workers for m in w.models}


def require_model(
    model: str, models: dict[str, dict[str, Any]], served: Iterable[str]
) -> dict[str, Any]:
    """The model's published info (`models`, from `known_models`); 404 if unknown, 503 if
    no live worker serves it (`served`)."""
    info = models.get(model)
    if info is None and model not in served:
        raise ModelNotFound(model)
    if model not in served:
        raise NoWorker(model)
    return info or {}


# ---------------------------------------------------------------- jobs


def get_record(conn: redis.Redis, job_id: str) -> JobRecord | None:
    raw = conn.hgetall(keys.job(job_id))
    if not raw:
        return None
    try:
        return JobRecord.from_hash(raw)
    except (KeyError, ValueError) as exc:
        log.warning("job %s has a malformed record: %s", job_id, exc)
        return None


def require_record(conn: redis.Redis, job_id: str, scope: str | None = None) -> JobRecord:
    """The job's record; 404 if there is none, or if it is another API key's (`scope`: the
    caller's owner digest, None for an unscoped caller)."""
    record = get_record(conn, job_id)
    if record is None or not visible(record.owner, scope):
        raise JobNotFound(job_id)
    return record


def enqueue(
    conn: redis.Redis,
    record: JobRecord,
    max_queue: int,
    replication: Replication | None = None,
    marks: dict[str, str] | None = None,
) -> str:
    """Write the record and put its id on one of the model's RQ queues; returns the
    queue's name.

    A job whose prompt prefix a worker holds waits on that worker's own queue while it has
    room (`_affine_queue`; see `workers.affinity`), any other on the shared queue; for RQ it
    is a job of the shared queue either way. One transaction writes the record and RQ's
    hash; then one script (`api.gate`) counts every queue of the model and kind and pushes
    only below `max_queue`, else deletes both. So concurrent submits from any number of API
    processes never push past it (docs/faults.md, F10), a job id is on a queue only if its
    record exists, and nothing is retried: a WATCHed check-then-push conflicted with every
    concurrent submission (2,464 retries for ~900 submissions in the load test). The wake
    token goes in the same script, so an idle worker starts the job now. (The script runs
    after the transaction, not in it: fakeredis, the unit tests' double, drops a connection
    that sends EVAL inside MULTI.) With `replication` on (Sentinel), `WAIT` follows the
    script on its connection: it returns once both writes are on enough replicas, else
    raises `NotReplicated`.
    """
    shared = rq_queue(conn, record.model, record.kind)
    # a job with a priority waits on its level of the shared queue, never on an own queue
    affine, room = _affine_queue(conn, record) if record.priority == 0 else (None, 0)
    with conn.pipeline() as pipe:
        # `marks`: hash fields other rooms read (`workers.wire.webhooks.notify_fields`)
        pipe.hset(keys.job(record.id), mapping={**record.to_hash(), **(marks or {})})
        pipe.expire(keys.job(record.id), JOB_TTL_SECONDS)
        write_queued_rq_job(pipe, conn, record.id, shared.name)
        pipe.execute()
    chosen, depth = _gate(conn, record, shared, affine, room, max_queue, replication)
    if chosen == 0:
        raise QueueFull(shared.name, int(depth))
    own = affine if chosen == 2 else None
    record.queue = None if own is None else own.name
    return own.name if own is not None else keys.level_queue_name(shared.name, record.priority)


def _gate(
    conn: redis.Redis,
    record: JobRecord,
    shared: Queue,
    affine: Queue | None,
    room: int,
    max_queue: int,
    replication: Replication | None = None,
) -> tuple[int, int]:
    """The submission gate (`api.gate`) for `record`: (0 full | 1 shared | 2 own queue, depth)."""
    own_prefix = ""
    if record.kind == keys.INTERACTIVE:
        own_prefix = Queue.redis_queue_namespace_prefix + keys.personal_queue_name(record.model, "")
    index = keys.jobs_of(record.owner) if record.kind == keys.INTERACTIVE else ""
    own_key, own_name = (affine.key, affine.name) if affine is not None else ("", "")
    shared_wake = keys.queue_wake(shared.name)
    gate_keys = GateKeys(
        shared_queue=shared.key,
        queues_set=Queue.redis_queues_keys,
        record=keys.job(record.id),
        rq_job=Job.key_for(record.id),
        own_queue=own_key,
        shared_wake=shared_wake,
        own_wake=keys.queue_wake(own_name) if affine is not None else shared_wake,
        jobs_metric=keys.METRIC_JOBS,
        owner_index=index,
        levels=keys.queue_levels(shared.name),
        refused=keys.refused_submission(record.id),
    )
    args = GateArgs(
        max_queue=max_queue,
        job_id=record.id,
        own_prefix=own_prefix,
        own_room=room,
        created_at=record.created_at,
        index_cutoff=record.created_at - JOB_TTL_SECONDS,
        own_queue_name=own_name,
        priority=record.priority,
    )
    return gate_submission(conn, gate_keys, args, replication)


def list_jobs(
    conn: redis.Redis, limit: int, after: str | None, scope: str | None, status: str | None
) -> tuple[list[JobRecord], bool]:
    """A page of the caller's jobs, newest first, and whether more follow."""

    def keep(record: JobRecord) -> bool:
        return status is None or record.status == status

    index = keys.jobs_of(scope)
    return cursor_page(conn, index, keys.job, JobRecord.from_hash, keep, limit, after, False)


def _affine_queue(conn: redis.Redis, record: JobRecord) -> tuple[Queue | None, int]:
    """The own queue of the worker that last ran this job's prompt prefix, and how many jobs
    may wait there (so it can start them now); (None, 0) when that worker is unknown, gone,
    draining or does not serve the queue."""
    if record.kind != keys.INTERACTIVE:
        return None, 0
    digest = prefix_digest(record.endpoint, record.request)
    if digest is None:
        return None, 0
    owner = conn.get(keys.affinity(record.model, digest))
    if owner is None:
        return None, 0
    name = keys.personal_queue_name(record.model, as_str(owner))
    try:
        info = WorkerInfo.from_hash(conn.hgetall(keys.worker(as_str(owner))))
    except (KeyError, ValueError):  # no hash (KeyError: name) or a malformed one
        return None, 0
    if not info.takes_own_queue(name):
        return None, 0
    room = AFFINITY_MAX_QUEUED
    if info.max_sequences > 0:  # beyond its step a job would wait there while others idle
        room = min(room, info.max_sequences - len(info.current_jobs))
    return Queue(name, connection=conn, serializer=JSONSerializer), room


def idempotency_key(scope: str, key: str) -> str:
    """Redis key for a client's Idempotency-Key, scoped to its API key (tenants never collide)."""
    digest = hashlib.sha256(f"{scope}\0{key}".encode()).hexdigest()
    return keys.idempotency(digest)


@dataclass
class Submission:
    record: JobRecord
    created: bool  # False when an Idempotency-Key matched an earlier job


def submit(
    conn: redis.Redis,
    endpoint: str,
    model: str,
    request: dict[str, Any],
    *,
    max_queue: int,
    idempotency: str | None = None,
    owner: str | None = None,
    spec: dict[str, Any] | None = None,
    priority: int = 0,
    response_model: str | None = None,
    reservation: rate_limit.Reservation | None = None,
    replication: Replication | None = None,
    job_id: str | None = None,
    responses: dict[str, Any] | None = None,
    marks: dict[str, str] | None = None,
) -> Submission:
    """Store and enqueue a job (or find the one an earlier request with the same
    Idempotency-Key made); `reservation`: the rate-limit tokens its end settles; `job_id`
    an id the caller chose (a response's `resp_...`), `responses` the Responses request a
    response's record carries (`workers.wire.responses_api`), `marks` more fields for its
    hash (a response's end notifies the webhooks: `workers.wire.webhooks.notify_fields`).

    With `replication` on, the job is acknowledged only once it is on enough replicas.
    When it is not (`NotReplicated`: the replicas lag, or the master failed over under
    the write) the caller answers 503, and what becomes of the job depends on whether the
    client can find it again (docs/faults.md F20): with an Idempotency-Key it stays, and
    the retry with the same key gets this very job (acknowledged once it is replicated);
    without one nobody can, so it is withdrawn (`flag_and_dequeue`: cancelled where it
    waits, stopped within a step where it runs) and the retry is a new job."""
    record = JobRecord(
        id=job_id or new_job_id(),
        endpoint=endpoint,
        model=model,
        request=request,
        owner=owner,
        spec=spec,
        priority=priority,
        response_model=response_model,
        responses=responses,
    )
    if reservation is not None:
        record.ratelimit_key = reservation.bucket
        record.ratelimit_tokens = reservation.tokens
        record.ratelimit_token_ms = reservation.token_ms
    if idempotency is not None:
        existing = _claim(conn, idempotency, record.id)
        if existing is not None:
            if existing.endpoint != endpoint:
                raise Conflict(
                    f"This Idempotency-Key was already used for a request to {existing.endpoint}.",
                    param="Idempotency-Key",
                )
            if replication is not None:  # the first request's job: on the replicas yet?
                replication.confirm(conn, keys.job(existing.id))
            return Submission(existing, created=False)
    try:
        queue_name = enqueue(conn, record, max_queue, replication, marks)
    except NotReplicated:
        if idempotency is None:
            flag_and_dequeue(conn, record.id)
        raise
    except BaseException:
        if idempotency is not None:
            conn.delete(idempotency)  # the first attempt failed: let a retry create the job
        raise
    log.info(
        "job %s queued: endpoint=%s model=%s queue=%s request_chars=%d",
        record.id,
        endpoint,
        model,
        queue_name,
        len(json.dumps(request)),
    )
    return Submission(record, created=True)


def _claim(conn: redis.Redis, key: str, job_id: str) -> JobRecord | None:
    """None if this request owns the key now; else the job an earlier request created."""
    deadline = time.monotonic() + IDEMPOTENCY_WAIT_SECONDS
    while True:
        if conn.set(key, job_id, nx=True, ex=JOB_TTL_SECONDS):
            return None
        existing = conn.get(key)
        if existing is not None:
            record = get_record(conn, as_str(existing))
            if record is not None:
                return record
        if time.monotonic() > deadline:
            raise Conflict(
                "A request with this Idempotency-Key is still being processed.",
                param="Idempotency-Key",
            )
        time.sleep(0.05)


def cancel(conn: redis.Redis, job_id: str, scope: str | None = None) -> JobRecord:
    """Ask for a job to stop; a job still on its queue is removed and cancelled here.

    Removing the id from the RQ queue (LREM) is atomic against a worker popping it, so
    exactly one side owns the job: if we removed it, we write its terminal state; if not, a
    worker has it and stops at the next step when it sees the cancel flag.
    """
    record = require_record(conn, job_id, scope)
    if record.status in TERMINAL_STATUSES:
        raise Conflict(f"Job {job_id} is already {record.status}.", code="job_finished")
    conn.set(keys.job_cancel(job_id), "1", ex=CANCEL_FLAG_TTL_SECONDS)
    if record.status == QUEUED:
        for queue_key in _waiting_on(conn, record):
            if conn.lrem(queue_key, 1, job_id):
                _mark_cancelled(conn, record)
                break
    return record


def _waiting_on(conn: redis.Redis, record: JobRecord) -> list[str]:
    """Keys of the queues a queued job may be on: the worker's own queue it was routed to,
    if any, then the shared one, or its level list for a priority other than 0 (jobs only
    ever move from an own queue to the shared one)."""
    shared_name = keys.level_queue_name(keys.queue_name(record.model, record.kind), record.priority)
    shared = Queue(shared_name, connection=conn).key
    if record.queue is None:
        return [shared]
    return [Queue(record.queue, connection=conn).key, shared]


def _mark_cancelled(conn: redis.Redis, record: JobRecord) -> None:
    error = cancelled_error()
    record.status, record.finished_at, record.error = CANCELLED, time.time(), error
    pipe = conn.pipeline()
    write_ending(pipe, record.id, CANCELLED, error, _events_apart())
    pipe.execute()
    rate_limit.settle(conn, record.id, used=0)  # it used nothing; after, not in, the MULTI
    try:  # keep RQ's own bookkeeping honest (CanceledJobRegistry); the job never ran
        Job.fetch(record.id, connection=conn, serializer=JSONSerializer).cancel()
    except (NoSuchJobError, InvalidJobOperation):
        pass
    log.info("job %s cancelled while queued", record.id)


def _events_apart() -> Any:
    """The events cluster's client when the streams live there (`api.config.events_conn`),
    else None: the stream is on `conn` with the record."""
    if not has_app_context():
        return None
    return current_app.extensions.get("events")


def flag_and_dequeue(conn: redis.Redis, job_id: str) -> None:
    """Set the job's cancel flag and, if it still waits on a queue, take it off (`cancel`),
    for a caller that no longer wants the answer (the client went away, or a sync call ran
    out of time). It never raises: nobody is left to tell, and a job already done stays so.
    """
    try:
        record = get_record(conn, job_id)
        if record is not None and record.status not in TERMINAL_STATUSES:
            cancel(conn, job_id)
            log.info("job %s cancelled: nobody waits for its answer", job_id)
    except (redis.RedisError, Conflict) as exc:
        log.warning("could not cancel job %s after disconnect: %s", job_id, exc)


def all_queues(conn: redis.Redis) -> list[Queue]:
    """llmq's RQ queues (RQ's own registry of queue keys, filtered to our prefix)."""
    names = llmq_queue_names(conn.smembers(Queue.redis_queues_keys))
    return [Queue(n, connection=conn, serializer=JSONSerializer) for n in names]
