"""`llmq webhooks`: the outbox dispatcher and the RQ worker that delivers webhooks.

The dispatcher reads `keys.WEBHOOK_OUTBOX` with a consumer group (XREADGROUP BLOCK; its own
pending entries first after a claim or an error, XAUTOCLAIM for those another dispatcher
has held for a minute), and for each entry and each endpoint subscribed to its event type
enqueues one RQ job on `keys.WEBHOOK_QUEUE` with a deterministic id (`delivery_id`, enqueued
with RQ's atomic `unique`: a re-dispatch finds the job and enqueues nothing), then XACKs and
XDELs the entry. The RQ job (`deliver`,
workers/webhooks/delivery.py) signs and POSTs; RQ's `Retry` reschedules a failure
(`wire.webhook_jobs.WebhookSettings`), and a delivery that failed its last attempt stays in
the queue's FailedJobRegistry: the dead-letter list (`wire.webhook_jobs.redeliver`).

What a webhooks process killed -9 leaves in flight (outbox entries read and not enqueued, a
delivery dequeued or started and not recorded, RQ's scheduler lock) is taken over by the
others, on any host, within `reaper.LEASE_SECONDS` + `REAP_SECONDS` (12 s): each
process holds a short lease in Redis, and the dispatcher thread sweeps for the work of
processes whose lease is gone (workers/webhooks/reaper.py, docs/faults.md F24).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.exceptions import DuplicateJobError
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from workers import keys
from workers.webhooks.delivery import DeliveryFailed
from workers.webhooks.reaper import REAP_SECONDS, Presence, Reaper
from workers.wire.webhook_jobs import (
    WebhookSettings,
    webhook_queue,
)
from workers.wire.webhooks import (
    NOTIFY_BATCH,
    OutboxEntry,
    all_endpoints,
    batch_event_type,
    event_body,
    response_event_type,
)

log = logging.getLogger("llmq.webhooks")

DELIVER_FUNCTION = "workers.webhooks.delivery.deliver"  # the only function this worker runs
# its name in deliveries enqueued before workers/webhooks/ was a package: queued, scheduled
# for a retry or dead-lettered (a month), each still runs as `DELIVER_FUNCTION`
FORMER_DELIVER_FUNCTIONS = ("workers.webhook_delivery.deliver",)
RESULT_TTL_SECONDS = 2 * 24 * 3600  # a delivered job's id stays: a re-dispatch finds it
DEAD_TTL_SECONDS = 30 * 24 * 3600  # the dead-letter list keeps a delivery a month
CLAIM_IDLE_MS = 60_000  # a live dispatcher's entry unacknowledged this long is taken


def delivery_id(event_id: str, endpoint_id: str) -> str:
    """The RQ job of one event to one endpoint (RQ's id alphabet)."""
    return f"whd_{event_id.removeprefix('evt_')}_{endpoint_id}"


# ---------------------------------------------------------------- the dispatcher


class Dispatcher:
    """Outbox entries -> one RQ delivery job per subscribed endpoint, then XACK + XDEL."""

    def __init__(
        self,
        conn: redis.Redis,
        settings: WebhookSettings,
        consumer: str | None = None,
        block_ms: int = 1000,
    ) -> None:
        self.conn = conn
        self.settings = settings
        self.queue = webhook_queue(conn)
        self.consumer = consumer or worker_name()  # its process's lease is under this name
        self.block_ms = block_ms
        self.own_pending = True  # set when entries were claimed for this consumer

    def ensure_group(self) -> None:
        try:
            self.conn.xgroup_create(
                keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_GROUP, "0", mkstream=True
            )
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def run_once(self) -> int:
        """Dispatch what waits (blocking up to `block_ms` when nothing does); how many."""
        entries = self._claimed() or self._read()
        for entry_id, fields in entries:
            self.dispatch(OutboxEntry.from_entry(entry_id, fields or {}))
            with self.conn.pipeline() as pipe:
                pipe.xack(keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_GROUP, entry_id)
                pipe.xdel(keys.WEBHOOK_OUTBOX, entry_id)
                pipe.execute()
        return len(entries)

    def _claimed(self) -> list[Any]:
        if self.own_pending:  # claimed from a dead dispatcher, or left by an error here
            got = self.conn.xreadgroup(
                keys.WEBHOOK_OUTBOX_GROUP, self.consumer, {keys.WEBHOOK_OUTBOX: "0"}, count=100
            )
            pending = got[0][1] if got else []
            self.own_pending = bool(pending)
            if pending:
                return pending
        reply = self.conn.xautoclaim(
            keys.WEBHOOK_OUTBOX,
            keys.WEBHOOK_OUTBOX_GROUP,
            self.consumer,
            CLAIM_IDLE_MS,
            "0-0",
            count=100,
        )
        return [e for e in reply[1] if e[1] is not None] if reply else []

    def _read(self) -> list[Any]:
        got = self.conn.xreadgroup(
            keys.WEBHOOK_OUTBOX_GROUP,
            self.consumer,
            {keys.WEBHOOK_OUTBOX: ">"},
            count=100,
            block=self.block_ms,
        )
        return got[0][1] if got else []

    def event_type(self, entry: OutboxEntry) -> str | None:
        if entry.kind == NOTIFY_BATCH:
            return batch_event_type(entry.status)
        result = None
        if entry.status == "finished":
            raw = self.conn.hget(keys.job(entry.id), "result")
            result = _json_object(raw)
        return response_event_type(entry.status, result)

    def dispatch(self, entry: OutboxEntry) -> list[str]:
        """Enqueue the entry's deliveries; the ids of those enqueued now."""
        event_type = self.event_type(entry)
        if event_type is None:
            log.warning(
                "outbox entry %s: no event for %s %s", entry.entry_id, entry.kind, entry.status
            )
            return []
        event = event_body(event_type, entry.id, entry.at_ms // 1000)
        enqueued = []
        for endpoint in all_endpoints(self.conn):
            if event_type not in endpoint.events:
                continue
            job_id = delivery_id(event["id"], endpoint.id)
            try:
                self.queue.enqueue(
                    DELIVER_FUNCTION,
                    endpoint.id,
                    event,
                    entry.at_ms,
                    job_id=job_id,
                    unique=True,  # one script: checked, saved and pushed at once
                    retry=self.settings.retry(),
                    job_timeout=int(self.settings.timeout) + 10,
                    result_ttl=RESULT_TTL_SECONDS,
                    failure_ttl=DEAD_TTL_SECONDS,
                    description=f"webhook {event_type} {event['id']} -> {endpoint.id}",
                    meta={"attempts": len(self.settings.intervals) + 1},
                )
            except DuplicateJobError:
                continue  # dispatched before (this entry again, or its end written twice)
            enqueued.append(job_id)
        return enqueued


def _json_object(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# ---------------------------------------------------------------- the dead-letter list


# ---------------------------------------------------------------- the process


class WebhookWorker(SimpleWorker):
    """RQ's SimpleWorker that runs only webhook deliveries (docs/faults.md F19: anything
    else found on its queue is failed, never called)."""

    def execute_job(self, job: Job, queue: Queue) -> None:
        if job.func_name in FORMER_DELIVER_FUNCTIONS:
            job.func_name = DELIVER_FUNCTION  # saved so with the run's outcome
        if job.func_name != DELIVER_FUNCTION:
            log.error("refused job %s: %s is not a webhook delivery", job.id, job.func_name)
            job.set_status(JobStatus.FAILED)
            FailedJobRegistry(queue=queue).add(job, exc_string="refused: not a webhook delivery")
            return
        super().execute_job(job, queue)

    stop_signalled = False  # SIGTERM/SIGINT came: a Redis error from here on ends the run

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        """A receiver's failure is logged by `deliver` in one line: no traceback for it."""
        if len(exc_info) > 1 and isinstance(exc_info[1], DeliveryFailed):
            return
        super().handle_exception(job, *exc_info)

    def request_stop(self, signum: int, frame: Any) -> None:
        self.stop_signalled = True
        super().request_stop(signum, frame)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # RQ starts its scheduler in `work()` and its maintenance, and `keep_scheduler` from
        # the dispatcher thread: one at a time, or two could see none running and both fork
        # one (two schedulers would enqueue a due retry twice)
        self.scheduler_lock = threading.Lock()

    def _start_scheduler(self, *args: Any, **kwargs: Any) -> None:
        with self.scheduler_lock:
            super()._start_scheduler(*args, **kwargs)

    def run_maintenance_tasks(self) -> None:
        with self.scheduler_lock:
            super().run_maintenance_tasks()


def worker_name() -> str:
    """A name no other start of a process shares (a restarted container may reuse its host
    name and pid): the RQ worker's, the outbox consumer's and the lease's."""
    return f"webhooks.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"


def keep_scheduler(worker: WebhookWorker) -> None:
    """Start RQ's scheduler of the webhook queue here when its lock is free (a dead holder's
    is dropped by `Reaper.drop_dead_scheduler_lock`): what RQ's worker does in its
    maintenance, which an idle worker blocked on its queue does not reach (retries waiting
    in the ScheduledJobRegistry would then wait for the next new job)."""
    with worker.scheduler_lock:
        scheduler = worker.scheduler
        if scheduler is None or (scheduler._process is not None and scheduler._process.is_alive()):
            return
        scheduler.acquire_locks(auto_start=True)


def dispatch_forever(
    conn: redis.Redis,
    settings: WebhookSettings,
    stop: threading.Event,
    worker: WebhookWorker,
    name: str,
) -> None:
    """The dispatcher's loop (a thread of `llmq webhooks`), with the reaper's sweeps that
    must not wait for the delivering worker; carries on after any error."""
    dispatcher = Dispatcher(conn, settings, consumer=name)
    reaper = Reaper(conn, name)
    reaped_at = float("-inf")
    while not stop.is_set():
        try:
            dispatcher.ensure_group()
            while not stop.is_set():
                dispatcher.run_once()
                if time.monotonic() - reaped_at >= REAP_SECONDS:
                    if reaper.sweep(dispatcher.consumer).entries:
                        dispatcher.own_pending = True
                    keep_scheduler(worker)
                    reaped_at = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - Redis gone, or a bad entry: never stop
            if isinstance(exc, redis.RedisError):
                log.warning("webhook dispatcher: %s; retrying in 1 s", exc)
            else:
                log.exception("webhook dispatcher failed; retrying in 1 s")
            dispatcher.own_pending = True  # what it had read is still pending for it
            stop.wait(1.0)


def run_webhooks(url: str | None, log_level: str = "INFO") -> int:
    """`llmq webhooks`: the dispatcher thread and one delivering RQ SimpleWorker with the
    scheduler on (RQ's scheduler moves retries that are due back to the queue)."""
    from workers.wire.broker import BrokerSettings

    settings = WebhookSettings.from_env()
    broker = BrokerSettings.from_env(url=url)
    _stop_on_signals()  # until RQ's own handlers, and again after them
    conn = broker.connect(socket_timeout=30, health_check_interval=10)
    stop, name = threading.Event(), worker_name()
    presence = Presence(broker.connect(socket_timeout=5), name)
    presence.start()  # before this process reads anything another could take over
    worker = WebhookWorker(
        [webhook_queue(conn)],
        connection=conn,
        serializer=JSONSerializer,
        name=name,
        log_job_description=False,
        maintenance_interval=10,
    )
    thread = threading.Thread(
        target=dispatch_forever,
        args=(broker.connect(socket_timeout=30), settings, stop, worker, name),
        name="webhook-dispatcher",
        daemon=True,
    )
    thread.start()
    log.info(
        "webhooks: %s, timeout %.1f s, %d attempts, allow %s",
        broker.describe(),
        settings.timeout,
        len(settings.intervals) + 1,
        ",".join(settings.allow) or "-",
    )
    try:
        worker.work(with_scheduler=True, logging_level=log_level)
    except redis.RedisError as exc:
        if not worker.stop_signalled:
            raise
        # asked to stop while Redis is unreachable (a Sentinel with no master): RQ's
        # teardown could not record the worker's death; its registration expires alone
        log.warning("webhooks: stopped; Redis is unreachable (%s)", exc)
    finally:
        stop.set()
        # RQ's handlers act on this worker, which is done: a signal while workers/cli.py
        # retries a run that lost Redis would otherwise reach a worker no longer running
        # and be ignored (a BUSY one's warm shutdown), leaving `llmq serve` to kill us
        _stop_on_signals()
        presence.stop()  # what is left here is taken over at the others' next sweep
    return 0


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT end the process now, with status 0, outside RQ's work loop."""

    def stop_now(signum: int, frame: Any) -> None:
        log.info("webhooks: stopped by %s", signal.Signals(signum).name)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop_now)
    signal.signal(signal.SIGINT, stop_now)
