"""`llmq webhooks`: the outbox dispatcher and the RQ worker that delivers webhooks.

The dispatcher reads `keys.WEBHOOK_OUTBOX` with a consumer group (XREADGROUP BLOCK; its own
pending entries first after a restart, XAUTOCLAIM for those a dead dispatcher left), and
for each entry and each endpoint subscribed to its event type enqueues one RQ job on
`keys.WEBHOOK_QUEUE` with a deterministic id (`delivery_id`: a re-dispatch finds the job
and enqueues nothing), then XACKs and XDELs the entry. The RQ job (`deliver`,
workers/webhook_delivery.py) signs and POSTs; RQ's `Retry` reschedules a failure
(`wire.webhook_jobs.WebhookSettings`), and a delivery that failed its last attempt stays in
the queue's FailedJobRegistry: the dead-letter list (`wire.webhook_jobs.redeliver`).

A webhooks process killed mid-delivery leaves an execution in RQ's StartedJobRegistry;
RQ retries it after the job's timeout + 60 s, and a webhooks process on the same host
retries it at once when it finds its worker's pid gone (`rescue_dead_deliveries`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, StartedJobRegistry
from rq.scheduler import SCHEDULER_KEY_TEMPLATE, RQScheduler
from rq.serializers import JSONSerializer

from workers import keys
from workers.webhook_delivery import DeliveryFailed
from workers.wire.text import as_str
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

DELIVER_FUNCTION = "workers.webhook_delivery.deliver"  # the only function this worker runs
RESULT_TTL_SECONDS = 2 * 24 * 3600  # a delivered job's id stays: a re-dispatch finds it
DEAD_TTL_SECONDS = 30 * 24 * 3600  # the dead-letter list keeps a delivery a month
CLAIM_IDLE_MS = 60_000  # another dispatcher's unacknowledged entry is taken after this
RESCUE_EVERY_SECONDS = 5.0


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
        self.consumer = consumer or worker_name()  # "webhooks.{host}.{pid}"
        self.block_ms = block_ms
        self._own_pending = True  # after a start: this consumer's unacknowledged entries

    def ensure_group(self) -> None:
        try:
            self.conn.xgroup_create(
                keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_GROUP, "0", mkstream=True
            )
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def take_over_dead(self) -> int:
        """Claim the pending entries of consumers that ran on this host and are gone (a
        dispatcher killed -9 between reading and acknowledging), at once rather than after
        `CLAIM_IDLE_MS`; how many."""
        host, taken = socket.gethostname(), 0
        for info in self.conn.xinfo_consumers(keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_GROUP):
            name = as_str(info["name"])
            if name == self.consumer or not _dead_here(name, host):
                continue
            pending = self.conn.xpending_range(
                keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_GROUP, "-", "+", 10_000, consumername=name
            )
            ids = [p["message_id"] for p in pending]
            if ids:
                self.conn.xclaim(
                    keys.WEBHOOK_OUTBOX,
                    keys.WEBHOOK_OUTBOX_GROUP,
                    self.consumer,
                    0,
                    ids,
                    justid=True,
                )
                taken += len(ids)
                self._own_pending = True
            self.conn.xgroup_delconsumer(keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_GROUP, name)
        return taken

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
        if self._own_pending:  # a restart under the same consumer name: its pending first
            got = self.conn.xreadgroup(
                keys.WEBHOOK_OUTBOX_GROUP, self.consumer, {keys.WEBHOOK_OUTBOX: "0"}, count=100
            )
            pending = got[0][1] if got else []
            self._own_pending = bool(pending)
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
            if Job.exists(job_id, connection=self.conn):
                continue  # dispatched before (this entry again, or its end written twice)
            self.queue.enqueue(
                DELIVER_FUNCTION,
                endpoint.id,
                event,
                entry.at_ms,
                job_id=job_id,
                retry=self.settings.retry(),
                job_timeout=int(self.settings.timeout) + 10,
                result_ttl=RESULT_TTL_SECONDS,
                failure_ttl=DEAD_TTL_SECONDS,
                description=f"webhook {event_type} {event['id']} -> {endpoint.id}",
                meta={"attempts": len(self.settings.intervals) + 1},
            )
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


def worker_name() -> str:
    return f"webhooks.{socket.gethostname()}.{os.getpid()}"


def _dead_here(name: str, host: str) -> bool:
    """Whether the process named `name` (`worker_name`) ran on this host and is gone."""
    prefix = f"webhooks.{host}."
    if not name.startswith(prefix):
        return False
    try:
        pid = int(name[len(prefix) :])
    except ValueError:
        return False
    return pid != os.getpid() and _pid_gone(pid)


def _pid_gone(pid: int) -> bool:
    """No such process here, or only its zombie (killed, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def rescue_dead_deliveries(conn: redis.Redis) -> int:
    """Retry at once the deliveries whose webhooks process on this host died mid-POST
    (kill -9: RQ would wait for the job's timeout + 60 s); how many."""
    queue = webhook_queue(conn)
    registry = StartedJobRegistry(queue=queue)
    host, rescued = socket.gethostname(), 0
    for job_id, execution_id in registry.get_job_and_execution_ids(cleanup=False):
        try:
            worker = Execution.fetch(execution_id, job_id, connection=conn).worker_name
        except ValueError:  # its hash expired: RQ's own cleanup takes it
            continue
        if not _dead_here(worker, host):
            continue
        try:
            job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
        except Exception:  # noqa: BLE001 - gone meanwhile: nothing to rescue
            continue
        with conn.pipeline() as pipe:
            registry.remove_executions(job, pipeline=pipe)
            if job.retries_left:
                job.retry(queue, pipe)
            else:
                queue.enqueue_job(job, pipeline=pipe, at_front=True)  # one more try
            pipe.execute()
        log.warning("delivery %s: its worker %s died mid-delivery; retrying it", job_id, worker)
        rescued += 1
    return rescued


_DELETE_IF = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end"


def clear_dead_scheduler_lock(conn: redis.Redis) -> bool:
    """Drop the webhook queue's RQ scheduler lock when its holder ran on this host and is
    gone (kill -9), so this process's scheduler starts now, not after the lock's TTL."""
    lock = RQScheduler.get_locking_key(keys.WEBHOOK_QUEUE)
    holder = conn.get(lock)
    if holder is None:
        return False
    info = {
        as_str(k): as_str(v)
        for k, v in conn.hgetall(SCHEDULER_KEY_TEMPLATE % as_str(holder)).items()
    }
    pid = int(info.get("pid") or 0)
    if info.get("hostname") != socket.gethostname() or pid <= 0 or not _pid_gone(pid):
        return False
    return bool(conn.eval(_DELETE_IF, 1, lock, holder))


def keep_scheduler(conn: redis.Redis, worker: SimpleWorker) -> None:
    """Take over RQ's scheduler of the webhook queue when its holder is gone: what RQ's
    worker does in its maintenance, which an idle worker blocked on its queue does not reach
    (retries waiting in the ScheduledJobRegistry would then wait for the next new job)."""
    scheduler = worker.scheduler
    if scheduler is None or (scheduler._process is not None and scheduler._process.is_alive()):
        return
    clear_dead_scheduler_lock(conn)
    scheduler.acquire_locks(auto_start=True)


def dispatch_forever(
    conn: redis.Redis, settings: WebhookSettings, stop: threading.Event, worker: SimpleWorker
) -> None:
    """The dispatcher's loop (a thread of `llmq webhooks`), with the rescues that must not
    wait for the delivering worker; reconnects after Redis errors."""
    dispatcher = Dispatcher(conn, settings)
    rescued_at = 0.0
    while not stop.is_set():
        try:
            dispatcher.ensure_group()
            while not stop.is_set():
                dispatcher.run_once()
                if time.monotonic() - rescued_at > RESCUE_EVERY_SECONDS:
                    dispatcher.take_over_dead()
                    rescue_dead_deliveries(conn)
                    keep_scheduler(conn, worker)
                    rescued_at = time.monotonic()
        except redis.RedisError as exc:
            log.warning("webhook dispatcher: %s; retrying in 1 s", exc)
            stop.wait(1.0)


def run_webhooks(url: str | None, log_level: str = "INFO") -> int:
    """`llmq webhooks`: the dispatcher thread and one delivering RQ SimpleWorker with the
    scheduler on (RQ's scheduler moves retries that are due back to the queue)."""
    from workers.wire.broker import BrokerSettings

    settings = WebhookSettings.from_env()
    broker = BrokerSettings.from_env(url=url)
    _stop_on_signals()  # until RQ's own handlers, and again after them
    conn = broker.connect(socket_timeout=30, health_check_interval=10)
    stop = threading.Event()
    clear_dead_scheduler_lock(conn)
    rescue_dead_deliveries(conn)
    worker = WebhookWorker(
        [webhook_queue(conn)],
        connection=conn,
        serializer=JSONSerializer,
        name=worker_name(),
        log_job_description=False,
        maintenance_interval=10,
    )
    thread = threading.Thread(
        target=dispatch_forever,
        args=(broker.connect(socket_timeout=30), settings, stop, worker),
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
    return 0


def _stop_on_signals() -> None:
    """SIGTERM and SIGINT end the process now, with status 0, outside RQ's work loop."""

    def stop_now(signum: int, frame: Any) -> None:
        log.info("webhooks: stopped by %s", signal.Signals(signum).name)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop_now)
    signal.signal(signal.SIGINT, stop_now)
