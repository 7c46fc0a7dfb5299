"""`llmq worker`: an RQ worker that keeps engines warm and runs many jobs in one batch.

RQ's own workers run one job at a time and fork per job, which throws away every loaded
model (docs/faults.md). This one registers with RQ as a worker (`rq_registries.RQWorker`)
and runs its own loop, in one process: while it generates it keeps taking jobs (up to
`max_sequences` sequences) and steps them together, one forward pass per model per step. RQ
still sees everything: the worker is registered (`rq info` lists it and its queues), and
each job goes through RQ's own bookkeeping with several executions open at once
(`workers.rq_registries`).

Per step, one script call carries every job's new token events (each write fenced by the
job's lease) and reads every job's cancel flag, with the metrics in the same pipeline; it
is sent beside the next step (`EventWriter.send` in its writer thread), and what it found
(lost leases, landed ends, cancels) is acted on right after that step.
Leases are renewed every `lease_renew` seconds; a reaper requeues the jobs of dead workers,
and the batch driver (`workers.batches`) moves offline batches on.
SIGTERM drains (no new jobs, `grace` seconds for running ones, then checkpoint-and-requeue);
a second SIGTERM or SIGINT checkpoints at once. A Redis outage pauses the loop, which
reconnects with backoff and never exits; events not yet written are kept and written first.

This module is the loop and the intake of claimed jobs. The loop holds its collaborators,
each an object with its own state and tests: `Claims` (taking and giving back jobs,
`workers.claims`), `Leases` (`workers.leases`), `EventWriter` (the fenced writes of a step,
`workers.event_writer`), `RQRegistries` (RQ's view, public rq calls only,
`workers.rq_registries`), `JobEnds` (what each way a job leaves means, `workers.job_ends`),
`Presence` and `Admin` (what it publishes, admin commands, `workers.presence`,
`workers.admin`), `RunningJobs` (which sequences step together, `workers.running`) and the
`EnginePool` (`workers.pool`).
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

from workers import affinity, batches, keys, metrics
from workers.admin import Admin, describe_models
from workers.claims import CANCELLED as CLAIMED_CANCELLED
from workers.claims import MISSING as CLAIMED_MISSING
from workers.claims import Claims
from workers.config import WorkerConfig, preload_models, serving, worker_device
from workers.errors import JobFailure, PoolFull
from workers.event_store import events_of
from workers.event_writer import EventWriter, Flushed
from workers.history import HistorySampler
from workers.job_ends import JobEnds
from workers.jobs import ActiveJob
from workers.leases import Leases
from workers.loop_clock import LoopClock
from workers.pool import EnginePool, load_engine
from workers.presence import POOL_STATS_SECONDS, Presence
from workers.progress import read_progress
from workers.recovery import Reaper
from workers.rq_registries import (
    REDIS_SOCKET_TIMEOUT,
    RQ_MONITORING_INTERVAL,
    RQ_WORKER_TTL,
    RQRegistries,
    RQWorker,
    refusal,
)
from workers.running import RunningJobs
from workers.wire.broker import BROKER_LOST, BrokerSettings
from workers.wire.defaults import JOB_TTL_SECONDS, MAX_ATTEMPTS, WORKER_HEARTBEAT_SECONDS
from workers.wire.job import STARTED, TERMINAL_STATUSES, JobRecord
from workers.wire.worker_info import WorkerInfo

log = logging.getLogger("llmq.worker")
# a worker with sequences running looks for more at most this often, not at every step:
# the claim is a round trip, and a GPU steps hundreds of times a second
CLAIM_WHILE_BUSY_SECONDS = 0.02

BACKOFF_SECONDS = (0.25, 0.5, 1, 2)  # a ping every 2 s at most: back soon after Redis
PRUNE_SECONDS = 10
SUSPENSION_CHECK_SECONDS = 1
LOAD_CHECK_SECONDS = 0.005  # a job waiting for its model starts this soon after the load
LOAD_PUBLISH_SECONDS = 0.05  # an idle worker publishes a finished load this soon


def connect(url: str | None = None, settings: BrokerSettings | None = None) -> redis.Redis:
    """A client whose commands are never retried behind our back: the loop retries itself,
    and only after it knows whether a write landed (see `scripts.append`). `url` names one
    Redis; else `settings` (or the environment) say where it is, Sentinel included."""
    if settings is None:
        settings = BrokerSettings(url=url) if url else BrokerSettings.from_env()
    return settings.connect(
        socket_timeout=REDIS_SOCKET_TIMEOUT,
        socket_connect_timeout=2,
        retry=Retry(NoBackoff(), 0),
        health_check_interval=30,
    )


class LLMQWorker:
    """The loop: claim -> step (beside the last step's writes) -> act on them -> send this
    step's writes -> chores, over the collaborators it holds."""

    def __init__(
        self,
        config: WorkerConfig,
        connection: redis.Redis | None = None,
        pool: EnginePool | None = None,
    ) -> None:
        self.config = config
        sources, shared_queues = serving(config)
        queue_names = affinity.personal_queues(shared_queues, config.worker_name)
        self.rq_worker = RQWorker(
            queue_names,
            name=config.worker_name,
            connection=connection or connect(settings=config.broker),
            serializer=JSONSerializer,
            log_job_description=False,  # docs/faults.md, F17: nothing of a job's text in logs
            worker_ttl=RQ_WORKER_TTL,
            job_monitoring_interval=RQ_MONITORING_INTERVAL,
            on_stop_job=self._stop_job,
        )
        self.name: str = self.rq_worker.name
        self.connection: redis.Redis = self.rq_worker.connection
        # the jobs' streams and leases, on this same client or on the events cluster: the
        # mode is read here, once; the parts below get the object that knows it
        self.events = events_of(
            self.connection,
            config.events.connect(
                self.connection, socket_timeout=REDIS_SOCKET_TIMEOUT, socket_connect_timeout=2
            ),
        )
        self.pool = pool or EnginePool(
            config.pool,
            sources,
            functools.partial(
                load_engine,
                backend=config.backend,
                device=config.device,
                kv_memory_mb=config.kv_memory_mb,
                gpu_memory_utilization=config.gpu_memory_utilization,
            ),
        )
        # models whose jobs the API may route here: only these record prefix affinity
        own_models = {keys.parse_queue_name(n)[0] for n in queue_names if keys.queue_owner(n)}
        self.leases = Leases(self.events, self.name, config.lease_ttl)
        self.claims = Claims(self.connection, self.leases, self.events)
        self.writer = EventWriter(self.connection, self.name, own_models, self.events)
        self._own_models = own_models
        self.rq = RQRegistries(self.rq_worker)
        self.running = RunningJobs(self.pool, config.max_sequences, self._sync_adapters)
        self.ends = JobEnds(self.connection, self.running, self.writer, self.rq, self.claims)
        self.reaper = Reaper(self.connection, self.name, self.leases.ttl_ms, self.events)
        self.batch_driver = batches.BatchDriver(self.connection, self.name, self.events)
        self.history = HistorySampler(self.connection)  # the dashboard's charts
        info = WorkerInfo(
            name=self.name,
            pid=os.getpid(),
            host=socket.gethostname(),
            models=list(sources),
            queues=queue_names,
            max_sequences=config.max_sequences,
            device=worker_device(config, sources),
        )
        wake_keys = [keys.queue_wake(name) for name in queue_names]  # jobs queued wake it
        self.presence = Presence(self.connection, info, describe_models(sources), wake_keys)
        self.admin = Admin(self.connection, self.name, self.pool, self.presence)
        queues = self.rq_worker.queues
        # a job on this worker's own queue is a job of the shared queue for RQ (its origin)
        self._queues_by_key = {q.key: self.rq.queue(q) for q in queues}
        self._models_by_key = {q.key: keys.parse_queue_name(q.name)[0] for q in queues}
        # interactive work before batch work, whatever the priorities (`scripts.claim`)
        self._ranks_by_key = {
            q.key: keys.QUEUE_KINDS.index(keys.parse_queue_name(q.name)[1]) for q in queues
        }
        self._released = False  # own queues handed back to the shared ones (draining)
        self._due: dict[str, float] = {}
        self._drain_deadline: float | None = None
        self._stop_now = False
        self._done = False
        self._suspended = False
        self._started = False
        self.steps = 0  # decode steps run (tests and logs read it)
        self.loop_clock = LoopClock()  # where the loop's time goes, published with presence

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

    def _stop_job(self, job_id: str) -> bool:
        """RQ's `stop-job` command (`rq_registries.RQWorker`): our cancel flag, if we run it."""
        if job_id not in self.running.jobs:
            return False
        self.connection.set(keys.job_cancel(job_id), "1", ex=JOB_TTL_SECONDS)
        return True

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
            except BROKER_LOST as exc:
                if self._drain_deadline is not None:
                    raise
                delay = BACKOFF_SECONDS[min(backoff, len(BACKOFF_SECONDS) - 1)]
                backoff += 1
                log.error("worker %s: Redis unavailable (%s); retry in %gs", self.name, exc, delay)
                time.sleep(delay)
        self._started = True

    def work(self) -> bool:
        """Run until drained or stopped; True if any job was run."""
        self.start()
        backoff = 0
        try:
            while not self._done:
                try:
                    self._tick()
                    backoff = 0
                except BROKER_LOST as exc:
                    if self._stop_now or self._grace_over():
                        break
                    delay = BACKOFF_SECONDS[min(backoff, len(BACKOFF_SECONDS) - 1)]
                    backoff += 1
                    log.error(
                        "worker %s: Redis unavailable (%s); retry in %gs", self.name, exc, delay
                    )
                    time.sleep(delay)
                except Exception:
                    if self._stop_now or self._grace_over():
                        log.exception("worker %s: the loop failed while stopping", self.name)
                        break
                    log.exception("worker %s: unexpected error in the loop; carrying on", self.name)
                    time.sleep(1)
        finally:
            self._shutdown()
        return self.rq.closed > 0

    def _grace_over(self) -> bool:
        """Told to stop, and its grace has run out. A loop that fails on every tick (Redis
        gone, a broken engine) never reaches the drain's own check in `_tick`: it leaves
        here instead, and its jobs' leases expire for the reaper to requeue them
        (docs/faults.md F2), as after a kill."""
        return self._drain_deadline is not None and time.monotonic() >= self._drain_deadline

    def _bootstrap(self) -> None:
        rq_key = self.rq_worker.key
        live = self.connection.exists(rq_key) and not self.connection.hexists(rq_key, "death")
        if live and not self.connection.exists(keys.worker(self.name)):
            self.connection.delete(rq_key)  # a dead worker of this name left its RQ hash
        self.rq_worker.register_birth()
        # `rq info` lists queues from this set, which RQ fills on the first enqueue
        self.connection.sadd(Queue.redis_queues_keys, *self.rq_worker.queue_keys())
        self.rq_worker.subscribe()
        self.rq_worker.set_state(WorkerStatus.IDLE)
        # loads run in the pool's thread: the worker registers now and takes jobs meanwhile
        self.pool.preload(preload_models(self.config, self.pool.sources))
        self.admin.inspect_models()
        self.presence.publish("idle", [], self.pool.snapshot())
        log.info(
            "worker %s (pid %d): serving %s on queues %s, max sequences %d",
            self.name,
            os.getpid(),
            ", ".join(self.pool.sources) or "no models",
            ", ".join(self.rq_worker.queue_names()),
            self.config.max_sequences,
        )

    def _tick(self) -> None:
        clock = self.loop_clock
        clock.start_tick()
        if self.writer.has_output(self.running.jobs.values()):
            self._flush()  # events a Redis outage kept from being written go out first
            clock.lap("writes")
        self._chores()
        clock.lap("chores")
        if self._drain_deadline is not None:
            if not self._released:
                self._publish()  # "stopping" first: the API routes nothing more here
                self.admin.release_own_queues(self.rq_worker.queue_names())
                self._released = True
            if not self.running.jobs:
                self._done = True
                return
            if self._stop_now or time.monotonic() >= self._drain_deadline:
                self._checkpoint_all()
                self._done = True
                return
        elif not self._suspended and (
            not self.running.jobs or self._due_now("claim", CLAIM_WHILE_BUSY_SECONDS)
        ):
            self._claim()
            clock.lap("claim")
        if self.writer.has_output(self.running.jobs.values()):
            self._flush()
            clock.lap("writes")
        if self.running.has_work():
            _, broken = self.running.step()
            self.steps += 1
            clock.lap("step")
            clock.stepped()
            self._act(self.writer.collect())  # the last step's writes, made beside this step
            clock.lap("writes")
            for job, exc in broken:
                if not self._runs(job):
                    continue  # ended by what the last step's writes found
                if not isinstance(exc, JobFailure):
                    exc = JobFailure(f"the engine failed: {type(exc).__name__}: {exc}")
                self.ends.fail(job, exc)
            clock.lap("ends")
            step_sizes = self.running.last_step_sizes
            self.writer.send(self.running.jobs.values(), step_sizes, background=True)
            clock.lap("writes")
            if self.config.step_delay:
                time.sleep(self.config.step_delay)
                clock.lap("idle")
        else:
            self._act(self.writer.collect())
            clock.lap("writes")
            self._idle()
            clock.lap("idle")

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
        self.admin.obey(self.presence.commands(wait=wait))

    def _chores(self) -> None:
        """Periodic work, each at its own pace."""
        for failed_job, failure in self.running.settle_loads():
            self.ends.fail(failed_job, failure)
        if self._due_now("renew", self.config.lease_renew):
            self._act(self.writer.collect())  # a landed end gave its lease up: not a lost one
            held = [job for job in self.running.jobs.values() if not job.ending_sent]
            for job in self.leases.renew(held):
                self.ends.drop(job)
        if self._due_now("rq_heartbeat", RQ_MONITORING_INTERVAL / 2):
            self.rq.heartbeat()
        if self._due_now("loras", WORKER_HEARTBEAT_SECONDS):
            self._sync_adapters()
        learned = self.admin.learn_models()
        pool = self.pool.snapshot()
        stats_moved = self.presence.pool_changed(pool)
        if (
            learned
            or self.presence.pool_state_changed(pool)
            or (stats_moved and self._due_now("pool stats", POOL_STATS_SECONDS))
            or self._due_now("presence", WORKER_HEARTBEAT_SECONDS)
        ):
            self._publish()
        if self._due_now("reap", self.config.reap_interval):
            for job_id in self.reaper.run():
                log.info("worker %s: requeued abandoned job %s", self.name, job_id)
            self.reaper.release_queues()
        if self._due_now("batches", batches.TICK_SECONDS):
            self.batch_driver.tick()  # offline batches: feed, collect, finalize (any worker)
        if self._due_now("history", 1.0):  # a round trip only once per sampling slot
            self.history.sample()
        if self._due_now("suspension", SUSPENSION_CHECK_SECONDS):
            self._suspended = is_suspended(self.connection, self.rq_worker)
        if self._due_now("prune", PRUNE_SECONDS):
            self.presence.prune()
            if not self.running.jobs and self.rq_worker.should_run_maintenance_tasks:
                self.rq_worker.run_maintenance_tasks()
        if self.running.jobs and self._due_now("commands", 0.5):  # busy or loading
            self.admin.obey(self.presence.commands())

    def _due_now(self, chore: str, every: float) -> bool:
        at = time.monotonic()
        if at < self._due.get(chore, 0.0):
            return False
        self._due[chore] = at + every
        return True

    def _publish(self) -> None:
        if self._stop_now or self._drain_deadline is not None:
            state = "stopping"
        else:
            state = "busy" if self.running.jobs else "idle"
        self.admin.publish(
            state,
            list(self.running.jobs),
            self.writer.tokens_per_second(),
            self.loop_clock.summary(),
        )

    def _sync_adapters(self) -> None:
        self.admin.sync_adapters()

    def _flush(self) -> None:
        """Write what the running jobs produced outside a step (`EventWriter.flush`, after
        the step in flight), and act on it."""
        self._act(self.writer.flush(self.running.jobs.values(), None))

    def _act(self, flushed: Flushed) -> None:
        """What writes found: lost leases, landed ends, cancel flags. A job that has left
        since (an end acted on earlier) is not ended twice."""
        for job in flushed.lost:
            if self._runs(job):
                self.ends.drop(job)
        for job in flushed.finished:
            if self._runs(job):
                self.ends.finished(job)
        for job in flushed.cancel_requested:
            if self._runs(job):
                self.ends.cancel(job)

    def _runs(self, job: ActiveJob) -> bool:
        return self.running.jobs.get(job.id) is job

    # ------------------------------------------------------------------ taking jobs

    def _claim(self) -> None:
        for _ in range(self.config.max_sequences):
            if not self.running.has_room():
                return
            queue_keys = [k for k, m in self._models_by_key.items() if self.pool.can_accept(m)]
            claim = self.claims.take(queue_keys, [self._ranks_by_key[k] for k in queue_keys])
            if claim is None:
                return
            try:
                queue = self._queues_by_key[queue_keys[claim.queue_index]]
                self._take(queue, claim.job_id, claim.attempt)
            except BROKER_LOST:
                raise
            except Exception:  # the reaper requeues it when the claim's lease runs out
                log.exception("job %s: could not be started", claim.job_id)

    def _take(self, queue: Queue, job_id: str, attempt: int) -> None:
        stale = self.running.jobs.get(job_id)
        if stale is not None:
            # requeued while it ran here (its lease lapsed while Redis was away): this
            # claim's lease fences the old run out, and the new one resumes from the stream
            self.ends.drop(stale)
        rq_job = self.rq.fetch(job_id)
        if attempt == CLAIMED_MISSING:
            self.ends.fail_orphan(rq_job, queue, "its job record is gone (expired or deleted)")
            return
        if attempt == CLAIMED_CANCELLED:
            self.ends.cancel_queued(job_id, rq_job, queue)
            return
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
        job = ActiveJob(record, attempt, self.leases.name(attempt), rq_job, queue)
        try:
            job.progress = read_progress(self.events.client, job_id)
        except (KeyError, ValueError, TypeError):
            job.progress.length = self.events.client.xlen(keys.job_events(job_id))
            failure = failure or JobFailure(f"job {job_id}: its event stream cannot be read")
        job.written = job.progress.length  # every write of ours is fenced on this
        if failure is not None:
            self.ends.fail(job, failure)
            return
        if record.status in TERMINAL_STATUSES or job.progress.terminal is not None:
            self.ends.settle_ended(job)
            return
        self._start(job)
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
            self.ends.fail(job, exc)
        except PoolFull:
            self.ends.checkpoint(job)

    def _start(self, job: ActiveJob) -> None:
        """RQ's start of an execution (one of several this worker has open), and ours."""
        with self.connection.pipeline() as pipe:
            if job.rq_job is not None:
                self.rq.open(job.rq_job, pipe)
            pipe.hset(keys.job(job.id), mapping={"status": STARTED, "worker": self.name})
            pipe.hsetnx(keys.job(job.id), "started_at", time.time())
            metrics.count_job(pipe, "started")
            if job.model in self._own_models:
                affinity.remember_start(pipe, self.name, job.record)
            pipe.execute()
        self.rq.sync_state()

    def _checkpoint_all(self) -> None:
        self._act(self.writer.collect())
        if self.writer.has_output(self.running.jobs.values()):
            self._flush()
        for job in list(self.running.jobs.values()):
            self.ends.checkpoint(job)

    def _shutdown(self) -> None:
        try:
            if self.running.jobs:
                self._checkpoint_all()
        except BROKER_LOST as exc:
            log.error(
                "worker %s: could not checkpoint (%s); the reaper will requeue", self.name, exc
            )
        try:
            self.writer.close()
        except BROKER_LOST as exc:
            log.error("worker %s: last writes not sent (%s); the reaper requeues", self.name, exc)
        self.pool.close()
        self.admin.close()
        try:
            self.presence.withdraw()
            self.admin.release_own_queues(self.rq_worker.queue_names())
            self.rq_worker.teardown()
        except BROKER_LOST as exc:
            log.error("worker %s: could not unregister (%s)", self.name, exc)
        self.events.close()  # the events cluster's connections, if any
        log.info("worker %s: stopped", self.name)
