"""`llmq webhooks`: one process, the outbox dispatcher's thread beside one RQ worker that
delivers (`WebhookWorker`, RQ's scheduler on: it moves retries that are due back to the
queue).

What a webhooks process killed -9 leaves in flight (outbox entries read and not enqueued, a
delivery dequeued or started and not recorded, RQ's scheduler lock) is taken over by the
others, on any host, within `reaper.LEASE_SECONDS` + `REAP_SECONDS` (12 s): each
process holds a short lease in Redis, and the dispatcher thread sweeps for the work of
processes whose lease is gone (workers/webhooks/reaper.py, docs/faults.md F24).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

import redis
from rq import Queue, SimpleWorker
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from workers.webhooks.delivery import DeliveryFailed
from workers.webhooks.dispatcher import DELIVER_FUNCTION, Dispatcher, worker_name
from workers.webhooks.reaper import REAP_SECONDS, Presence, Reaper
from workers.wire.webhook_jobs import WebhookSettings, webhook_queue

log = logging.getLogger("llmq.webhooks")

# the delivery's function in jobs enqueued before workers/webhooks/ was a package: queued,
# scheduled for a retry or dead-lettered (a month), each still runs as `DELIVER_FUNCTION`
FORMER_DELIVER_FUNCTIONS = ("workers.webhook_delivery.deliver",)


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
