"""`llmq worker`: an RQ worker that keeps engines warm and runs many jobs in one batch.

RQ's own workers run one job at a time and fork per job, which throws away every loaded
model (RELIABILITY 5). This one is an RQ `BaseWorker` with its own loop, in one process:
while it generates it keeps taking jobs (up to `max_batch` sequences) and steps them
together, one forward pass per model per step. RQ still sees everything: the worker is
registered (`rq info` lists it and its queues), and each job goes through RQ's own
bookkeeping with several executions open at once (`workers.executions`).

Per step, one pipeline carries every job's new token events (each write fenced by the
job's lease), their progress counters and the metrics, and reads every job's cancel flag.
Leases are renewed every `lease_renew` seconds; a reaper requeues the jobs of dead workers,
and the batch driver (`workers.batches`) moves offline batches on.
SIGTERM drains (no new jobs, `grace` seconds for running ones, then checkpoint-and-requeue);
a second SIGTERM or SIGINT checkpoints at once. A Redis outage pauses the loop, which
reconnects with backoff and never exits; events not yet written are kept and written first.

This module is the main loop and claiming; the rest of the worker is in one module each:
fenced writes, ends of jobs and leases (`workers.job_writes`), RQ's bookkeeping
(`workers.rq_bookkeeping`), presence and admin commands (`workers.admin`); which sequences
step together is `workers.running`.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import socket
import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.suspension import is_suspended
from rq.worker import WorkerStatus

from workers import affinity, batches, keys, metrics, scripts
from workers.admin import AdminDuties, describe_models
from workers.config import WorkerConfig, preload_models, serving, worker_device
from workers.errors import JobFailure, PoolFull
from workers.job_writes import JobWrites
from workers.jobs import ActiveJob
from workers.pool import EnginePool, load_engine
from workers.presence import Presence
from workers.progress import read_progress
from workers.recovery import Reaper
from workers.rq_bookkeeping import REDIS_SOCKET_TIMEOUT, RQBookkeeping, refusal
from workers.running import RunningJobs
from workers.wire.defaults import MAX_ATTEMPTS, WORKER_HEARTBEAT_SECONDS
from workers.wire.job import (
    TERMINAL_STATUSES,
    JobRecord,
)
from workers.wire.worker_info import WorkerInfo

log = logging.getLogger("llmq.worker")

RQ_WORKER_TTL = 20  # RQ's worker hash lives this + 60 s past the last heartbeat
RQ_MONITORING_INTERVAL = 10  # our executions' StartedJobRegistry scores are refreshed this often
BACKOFF_SECONDS = (0.5, 1, 2, 5, 10)
PRUNE_SECONDS = 10
SUSPENSION_CHECK_SECONDS = 1
LOAD_CHECK_SECONDS = 0.005  # a job waiting for its model starts this soon after the load
LOAD_PUBLISH_SECONDS = 0.05  # an idle worker publishes a finished load this soon


def connect(url: str) -> redis.Redis:
    """A client whose commands are never retried behind our back: the loop retries itself,
    and only after it knows whether a write landed (see `scripts.append`)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=REDIS_SOCKET_TIMEOUT,
        socket_connect_timeout=2,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=30,
    )


class LLMQWorker(JobWrites, AdminDuties, RQBookkeeping):
    log_result_lifespan = False

    def __init__(
        self,
        config: WorkerConfig,
        connection: redis.Redis | None = None,
        pool: EnginePool | None = None,
    ) -> None:
        self.config = config
        sources, shared_queues = serving(config)
        queue_names = affinity.personal_queues(shared_queues, config.worker_name)
        super().__init__(
            queue_names,
            name=config.worker_name,
            connection=connection or connect(config.redis_url),
            serializer=JSONSerializer,
            log_job_description=False,  # RELIABILITY 9: nothing about a job's text in logs
            worker_ttl=RQ_WORKER_TTL,
            job_monitoring_interval=RQ_MONITORING_INTERVAL,
        )
        self.pool = pool or EnginePool(
            config.pool,
            sources,
            functools.partial(load_engine, backend=config.backend, device=config.device),
        )
        self.running = RunningJobs(self.pool, config.max_batch, self.sync_adapters)
        self.reaper = Reaper(self.connection, self.name, self._lease_ms)
        self.batch_driver = batches.BatchDriver(self.connection, self.name)
        info = WorkerInfo(
            name=self.name,
            pid=os.getpid(),
            host=socket.gethostname(),
            models=list(sources),
            queues=queue_names,
            max_batch=config.max_batch,
            device=worker_device(config, sources),
        )
        wake_keys = [keys.queue_wake(name) for name in queue_names]  # jobs queued wake it
        self.presence = Presence(self.connection, info, describe_models(sources), wake_keys)
        # a job on this worker's own queue is a job of the shared queue for RQ (its origin)
        self._queues_by_key = {q.key: self._rq_queue(q) for q in self.queues}
        self._models_by_key = {q.key: keys.parse_queue_name(q.name)[0] for q in self.queues}
        # models whose jobs the API may route here: only these record prefix affinity
        self._own_models = {keys.parse_queue_name(n)[0] for n in queue_names if keys.queue_owner(n)}
        self._released = False  # own queues handed back to the shared ones (draining)
        self._due: dict[str, float] = {}
        self._drain_deadline: float | None = None
        self._stop_now = False
        self._done = False
        self._suspended = False
        self._started = False
        self._throughput = metrics.Throughput()
        self._inspections = {}  # model -> has it a chat template (`inspect_models`)
        self.steps = 0  # decode steps run (tests and logs read it)

    # ------------------------------------------------------------------ signals

    def request_stop(self, signum: int, frame: Any) -> None:
        """SIGTERM/SIGINT (and `rq shutdown`): drain; the second one checkpoints at once."""
        if self._drain_deadline is None:
            log.info(
                "worker %s: %s received: taking no new jobs, %gs for running ones to finish",
                self.name,
                signal.Signals(signum).name,
                self.config.grace,
            )
            self._drain_deadline = time.monotonic() + self.config.grace
        else:
            log.warning("worker %s: second signal: checkpointing running jobs now", self.name)
            self._stop_now = True

    # ------------------------------------------------------------------ main loop

    def start(self) -> None:
        """Register with RQ and publish this worker; waits for Redis if it is not up yet."""
        if self._started:
            return
        if self.config.install_signals:
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
        backoff = 0
        while True:
            try:
                self._bootstrap()
                break
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if self._drain_deadline is not None:
                    raise
                delay = BACKOFF_SECONDS[min(backoff, len(BACKOFF_SECONDS) - 1)]
                backoff += 1
                log.error("worker %s: Redis unavailable (%s); retry in %gs", self.name, exc, delay)
                time.sleep(delay)
        self._started = True

    def work(self, **_: Any) -> bool:  # type: ignore[override]
        """Run until drained or stopped; True if any job was run."""
        self.start()
        backoff = 0
        try:
            while not self._done:
                try:
                    self._tick()
                    backoff = 0
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    if self._stop_now:
                        break
                    delay = BACKOFF_SECONDS[min(backoff, len(BACKOFF_SECONDS) - 1)]
                    backoff += 1
                    log.error(
                        "worker %s: Redis unavailable (%s); retry in %gs", self.name, exc, delay
                    )
                    time.sleep(delay)
                except Exception:
                    log.exception("worker %s: unexpected error in the loop; carrying on", self.name)
                    time.sleep(1)
        finally:
            self._shutdown()
        return self.successful_job_count + self.failed_job_count > 0

    def _bootstrap(self) -> None:
        live = self.connection.exists(self.key) and not self.connection.hexists(self.key, "death")
        if live and not self.connection.exists(keys.worker(self.name)):
            self.connection.delete(self.key)  # a dead worker of this name left its RQ hash
        self.register_birth()
        # `rq info` lists queues from this set, which RQ fills on the first enqueue
        self.connection.sadd(Queue.redis_queues_keys, *self.queue_keys())
        self.subscribe()
        self.set_state(WorkerStatus.IDLE)
        # loads run in the pool's thread: the worker registers now and takes jobs meanwhile
        self.pool.preload(preload_models(self.config, self.pool.sources))
        self.inspect_models()
        self.presence.publish("idle", [], self.pool.snapshot())
        log.info(
            "worker %s (pid %d): serving %s on queues %s, max batch %d",
            self.name,
            os.getpid(),
            ", ".join(self.pool.sources) or "no models",
            ", ".join(self.queue_names()),
            self.config.max_batch,
        )

    def _tick(self) -> None:
        if self._has_output():
            self._flush()  # events a Redis outage kept from being written go out first
        self._chores()
        if self._drain_deadline is not None:
            if not self._released:
                self._publish()  # "stopping" first: the API routes nothing more here
                self._release_own_queues()
                self._released = True
            if not self.running.jobs:
                self._done = True
                return
            if self._stop_now or time.monotonic() >= self._drain_deadline:
                self._checkpoint_all()
                self._done = True
                return
        elif not self._suspended:
            self._claim()
        if self._has_output():
            self._flush()
        if self.running.has_work():
            _, broken = self.running.step()
            self.steps += 1
            for job, exc in broken:
                if not isinstance(exc, JobFailure):
                    exc = JobFailure(f"the engine failed: {type(exc).__name__}: {exc}")
                self._fail(job, exc)
            self._flush(step=True)
            if self.config.step_delay:
                time.sleep(self.config.step_delay)
        else:
            self._idle()

    def _idle(self) -> None:
        """Wait for work: a queued job's wake token or an admin command ends the wait at
        once, the poll interval at the latest. Jobs waiting for their model to load (in the
        pool's thread, whose end wakes nothing) are checked on every `LOAD_CHECK_SECONDS`."""
        if self.running.jobs:
            time.sleep(LOAD_CHECK_SECONDS)
            return
        wait = self.config.poll_interval
        if self.pool.loading:  # a preload's end is published (/ready) without delay
            wait = min(wait, LOAD_PUBLISH_SECONDS)
        self._handle_commands(self.presence.commands(wait=wait))

    def _chores(self) -> None:
        """Periodic work, each at its own pace."""
        for failed_job, failure in self.running.settle_loads():
            self._fail(failed_job, failure)
        if self._due_now("renew", self.config.lease_renew):
            self._renew_leases()
        if self._due_now("rq_heartbeat", RQ_MONITORING_INTERVAL / 2):
            self.heartbeat_executions()
        if self._due_now("loras", WORKER_HEARTBEAT_SECONDS):
            self.sync_adapters()
        pool = self.pool.snapshot()
        learned = self._learn_models()
        if (
            learned
            or pool != self.presence.info.pool
            or self._due_now("presence", WORKER_HEARTBEAT_SECONDS)
        ):
            self._publish()
        if self._due_now("reap", self.config.reap_interval):
            for job_id in self.reaper.run():
                log.info("worker %s: requeued abandoned job %s", self.name, job_id)
            self.reaper.release_queues()
        if self._due_now("batches", batches.TICK_SECONDS):
            self.batch_driver.tick()  # offline batches: feed, collect, finalize (any worker)
        if self._due_now("suspension", SUSPENSION_CHECK_SECONDS):
            self._suspended = is_suspended(self.connection, self)
        if self._due_now("prune", PRUNE_SECONDS):
            self.presence.prune()
            if not self.running.jobs and self.should_run_maintenance_tasks:
                self.run_maintenance_tasks()
        if self.running.jobs and self._due_now("commands", 0.5):  # busy or loading
            self._handle_commands(self.presence.commands())

    def _due_now(self, chore: str, every: float) -> bool:
        at = time.monotonic()
        if at < self._due.get(chore, 0.0):
            return False
        self._due[chore] = at + every
        return True

    # ------------------------------------------------------------------ taking jobs

    def _claim(self) -> None:
        for _ in range(self.config.max_batch):
            if not self.running.has_room():
                return
            queue_keys = [k for k, m in self._models_by_key.items() if self.pool.can_accept(m)]
            claimed = scripts.claim(self.connection, queue_keys, self.name, self._lease_ms)
            if claimed is None:
                return
            index, job_id, attempt = claimed
            try:
                self._take(self._queues_by_key[queue_keys[index]], job_id, attempt)
            except (redis.ConnectionError, redis.TimeoutError):
                raise
            except Exception:  # the reaper requeues it when the claim's lease runs out
                log.exception("job %s: could not be started", job_id)

    def _take(self, queue: Queue, job_id: str, attempt: int) -> None:
        rq_job = self._fetch_rq_job(job_id)
        if attempt == scripts.CLAIMED_MISSING:
            self._fail_orphan(rq_job, queue, "its job record is gone (expired or deleted)")
            return
        if attempt == scripts.CLAIMED_CANCELLED:
            self._cancel_queued(job_id, rq_job, queue)
            return
        lease = f"{self.name}:{attempt}"
        failure: JobFailure | None = refusal(rq_job, job_id)
        if attempt > MAX_ATTEMPTS:  # it took down (or out) every worker that ran it
            failure = failure or JobFailure(
                f"job {job_id} was started {attempt - 1} times without finishing; giving up"
            )
        try:
            record = JobRecord.from_hash(self.connection.hgetall(keys.job(job_id)))
        except (KeyError, ValueError, TypeError):
            record = JobRecord(job_id, "", "", {})
            failure = failure or JobFailure(f"job {job_id}: its record cannot be read")
        job = ActiveJob(record, attempt, lease, rq_job, queue)
        try:
            job.progress = read_progress(self.connection, job_id)
        except (KeyError, ValueError, TypeError):
            job.progress.length = self.connection.xlen(keys.job_events(job_id))
            failure = failure or JobFailure(f"job {job_id}: its event stream cannot be read")
        job.written = job.progress.length  # every write of ours is fenced on this
        if failure is not None:
            self._fail(job, failure)
            return
        if record.status in TERMINAL_STATUSES or job.progress.terminal is not None:
            self._settle_ended(job)
            return
        self._rq_start(job)
        log.info(
            "job %s: started (attempt %d, model %s, %s, %d tokens already streamed)",
            job_id,
            attempt,
            record.model,
            queue.name,
            job.progress.tokens,
        )
        try:
            self.running.add(job)
        except JobFailure as exc:
            self._fail(job, exc)
        except PoolFull:
            self._checkpoint(job)

    def _shutdown(self) -> None:
        try:
            if self.running.jobs:
                self._checkpoint_all()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.error(
                "worker %s: could not checkpoint (%s); the reaper will requeue", self.name, exc
            )
        self.pool.close()
        self.close_inspections()
        try:
            self.presence.withdraw()
            self._release_own_queues()
            self.teardown()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.error("worker %s: could not unregister (%s)", self.name, exc)
        log.info("worker %s: stopped", self.name)
