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
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.suspension import is_suspended
from rq.worker import WorkerStatus

from runtime.registry import load_registry
from workers import affinity, batches, keys, metrics, scripts
from workers.config import WorkerConfig, serving
from workers.errors import JobFailure, JobRefused, PoolFull
from workers.executions import ConcurrentWorker
from workers.jobs import ActiveJob
from workers.pool import EnginePool
from workers.presence import Presence
from workers.progress import read_progress
from workers.recovery import Reaper, requeue
from workers.scheduler import Scheduler
from workers.wire.commands import COMMAND_LOAD
from workers.wire.defaults import JOB_TTL_SECONDS, MAX_ATTEMPTS, WORKER_HEARTBEAT_SECONDS
from workers.wire.errors import cancelled_error
from workers.wire.events import ending, write_ending
from workers.wire.job import (
    CANCELLED,
    FAILED,
    FINISHED,
    JOB_FUNCTION,
    STARTED,
    TERMINAL_STATUSES,
    JobRecord,
)
from workers.wire.worker_info import WorkerInfo

log = logging.getLogger("llmq.worker")

RQ_WORKER_TTL = 20  # RQ's worker hash lives this + 60 s past the last heartbeat
RQ_MONITORING_INTERVAL = 10  # our executions' StartedJobRegistry scores are refreshed this often
REDIS_SOCKET_TIMEOUT = 5
BACKOFF_SECONDS = (0.5, 1, 2, 5, 10)
PRUNE_SECONDS = 10
SUSPENSION_CHECK_SECONDS = 1
LOAD_CHECK_SECONDS = 0.005  # a job waiting for its model starts this soon after the load


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


class LLMQWorker(ConcurrentWorker):
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
        self.pool = pool or EnginePool(config.pool, sources)
        self.batcher = Scheduler(self.pool, config.max_batch)
        self.reaper = Reaper(self.connection, self.name, self._lease_ms)
        self.batch_driver = batches.BatchDriver(self.connection, self.name)
        info = WorkerInfo(
            name=self.name,
            pid=os.getpid(),
            host=socket.gethostname(),
            models=list(sources),
            queues=queue_names,
            max_batch=config.max_batch,
        )
        wake_keys = [keys.queue_wake(name) for name in queue_names]  # jobs queued wake it
        self.presence = Presence(self.connection, info, _describe_models(sources), wake_keys)
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
        self.steps = 0  # decode steps run (tests and logs read it)

    # ------------------------------------------------------------------ RQ overrides

    @property
    def connection_timeout(self) -> int:
        return REDIS_SOCKET_TIMEOUT  # RQ's default (minutes) would hide a dead Redis

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

    def handle_payload(self, message: dict[str, Any]) -> None:
        """RQ's pub/sub commands: `stop-job` becomes our cancel flag (a non-forking worker
        has no horse to kill); `shutdown` arrives as SIGINT through RQ's own handler."""
        try:
            payload = json.loads(message["data"].decode())
        except (ValueError, KeyError, AttributeError):
            return
        if payload.get("command") == "stop-job" and payload.get("job_id") in self.batcher.jobs:
            self.connection.set(keys.job_cancel(payload["job_id"]), "1", ex=JOB_TTL_SECONDS)
            return
        super().handle_payload(message)

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
        if self.config.device != "cpu":
            log.info(
                "worker %s: --device %s requested; the numpy engine runs on the CPU",
                self.name,
                self.config.device,
            )
        live = self.connection.exists(self.key) and not self.connection.hexists(self.key, "death")
        if live and not self.connection.exists(keys.worker(self.name)):
            self.connection.delete(self.key)  # a dead worker of this name left its RQ hash
        self.register_birth()
        # `rq info` lists queues from this set, which RQ fills on the first enqueue
        self.connection.sadd(Queue.redis_queues_keys, *self.queue_keys())
        self.subscribe()
        self.set_state(WorkerStatus.IDLE)
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
            if not self.batcher.jobs:
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
        if self.batcher.has_work():
            _, broken = self.batcher.step()
            self.steps += 1
            for job, exc in broken:
                self._fail(job, JobFailure(f"the engine failed: {type(exc).__name__}: {exc}"))
            self._flush(step=True)
            if self.config.step_delay:
                time.sleep(self.config.step_delay)
        else:
            self._idle()

    def _idle(self) -> None:
        """Wait for work: a queued job's wake token or an admin command ends the wait at
        once, the poll interval at the latest. Jobs waiting for their model to load (in the
        pool's thread, whose end wakes nothing) are checked on every `LOAD_CHECK_SECONDS`."""
        if self.batcher.jobs:
            time.sleep(LOAD_CHECK_SECONDS)
            return
        self._handle_commands(self.presence.commands(wait=self.config.poll_interval))

    def _chores(self) -> None:
        """Periodic work, each at its own pace."""
        for failed_job, failure in self.batcher.settle_loads():
            self._fail(failed_job, failure)
        if self._due_now("renew", self.config.lease_renew):
            self._renew_leases()
        if self._due_now("rq_heartbeat", RQ_MONITORING_INTERVAL / 2):
            self.heartbeat_executions()
        pool = self.pool.snapshot()
        if pool != self.presence.info.pool or self._due_now("presence", WORKER_HEARTBEAT_SECONDS):
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
            if not self.batcher.jobs and self.should_run_maintenance_tasks:
                self.run_maintenance_tasks()
        if self.batcher.jobs and self._due_now("commands", 0.5):  # busy or loading
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
            if not self.batcher.has_room():
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
        failure: JobFailure | None = _refusal(rq_job, job_id)
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
            self.batcher.add(job)
        except JobFailure as exc:
            self._fail(job, exc)
        except PoolFull:
            self._checkpoint(job)

    def _rq_queue(self, queue: Queue) -> Queue:
        if keys.queue_owner(queue.name) is None:
            return queue
        shared = keys.shared_queue_name(queue.name)
        return Queue(shared, connection=self.connection, serializer=JSONSerializer)

    def _fetch_rq_job(self, job_id: str) -> Job | None:
        try:
            return Job.fetch(job_id, connection=self.connection, serializer=JSONSerializer)
        except NoSuchJobError:
            return None
        except Exception:  # an entry that is not an RQ job we can read
            log.error("job %s: its RQ job cannot be read", job_id)
            return None

    # ------------------------------------------------------------------ writing out

    def _has_output(self) -> bool:
        return any(j.pending or j.result is not None for j in self.batcher.jobs.values())

    def _flush(self, step: bool = False) -> None:
        """One round trip: every job's new events (fenced), finished jobs' results, metrics,
        and every running job's cancel flag."""
        jobs = list(self.batcher.jobs.values())
        writes: list[tuple[ActiveJob, list[tuple[str, str]], bool]] = []
        tokens: dict[str, int] = {}
        with self.connection.pipeline(transaction=False) as pipe:
            for job in jobs:
                if not job.pending and job.result is None:
                    continue
                events, final = list(job.pending), job.result is not None
                fields = {"completion_tokens": str(job.completion_tokens)}
                if final:
                    end_fields, end_event = ending(FINISHED, job.result)
                    events.append(end_event)
                    fields.update(end_fields)
                    fields["prompt_tokens"] = str(job.result["usage"]["prompt_tokens"])
                scripts.append(
                    pipe, job.id, job.lease, job.written, events, fields, final, JOB_TTL_SECONDS
                )
                writes.append((job, events, final))
                tokens[job.model] = tokens.get(job.model, 0) + len(job.pending)
            checked = [j for j in jobs if j.result is None]
            for job in checked:
                pipe.exists(keys.job_cancel(job.id))
            self._record_metrics(pipe, writes, tokens if step else {}, step)
            self._remember_replies(pipe, writes)
            results = pipe.execute()
        for (job, events, final), written in zip(writes, results, strict=False):
            if written is None:
                self._drop(job)
                continue
            job.pending.clear()
            job.written += len(events)
            if final:
                self._finish(job)
        flags = results[len(writes) : len(writes) + len(checked)]
        for job, flagged in zip(checked, flags, strict=True):
            if flagged and job.id in self.batcher.jobs:
                self._cancel(job)

    def _record_metrics(self, pipe: Any, writes: list, tokens: dict[str, int], step: bool) -> None:
        if step:
            metrics.record_step(pipe, self.batcher.last_batch_sizes, tokens)
            self._throughput.add(sum(tokens.values()))
        for job, _, final in writes:
            if final and job.result is not None:
                prompt_tokens = job.result["usage"]["prompt_tokens"]
                metrics.count_prompt_tokens(pipe, job.model, prompt_tokens)
                metrics.count_prefix_cache(pipe, job.model, job.prefill_tokens, job.cached_tokens)
            if job.attempt == 1 and job.first_token_at is not None and not job.ttft_recorded:
                metrics.record_ttft(pipe, job.model, max(0.0, time.time() - job.record.created_at))
                job.ttft_recorded = True

    def _remember_replies(self, pipe: Any, writes: list) -> None:
        for job, _, final in writes:
            if final and job.result is not None and job.model in self._own_models:
                affinity.remember_reply(pipe, self.name, job.record, job.result)

    def _end(
        self,
        job: ActiveJob,
        status: str,
        body: dict[str, Any],
    ) -> bool:
        """Fenced terminal write of a failed or cancelled job; False if it was not ours."""
        self.batcher.remove(job)
        end_fields, end_event = ending(status, body)
        events = [*job.pending, end_event]
        fields = {**end_fields, "completion_tokens": str(job.completion_tokens)}
        written = scripts.append(
            self.connection, job.id, job.lease, job.written, events, fields, True, JOB_TTL_SECONDS
        )
        if written is None:
            self._drop(job)
            return False
        job.pending.clear()
        job.written += len(events)
        return True

    def _finish(self, job: ActiveJob) -> None:
        self.batcher.remove(job)
        log.info("job %s: finished (%d completion tokens)", job.id, job.completion_tokens)
        self._rq_success(job)

    def _fail(self, job: ActiveJob, failure: JobFailure) -> None:
        log.warning("job %s: failed with %d: %s", job.id, failure.status, failure)
        if self._end(job, FAILED, failure.body()):
            self._rq_failure(job.rq_job, job.queue, f"{type(failure).__name__}: {failure}")

    def _cancel(self, job: ActiveJob) -> None:
        log.info("job %s: cancelled after %d tokens", job.id, job.completion_tokens)
        if self._end(job, CANCELLED, cancelled_error()):
            self._rq_cancelled(job.rq_job, job.queue)

    def _drop(self, job: ActiveJob) -> None:
        """The job is not ours any more (lease lost): stop it without writing anything."""
        log.warning("job %s: lease lost (another worker owns it now); dropped", job.id)
        self.batcher.remove(job)
        self.forget_execution(job.id)
        self.sync_state()

    def _settle_ended(self, job: ActiveJob) -> None:
        """A claimed job that had already ended (an earlier worker died between its final
        write and RQ's bookkeeping): give the claim back and make RQ agree. Its end was
        counted by the write that ended it."""
        with self.connection.pipeline() as pipe:
            pipe.srem(keys.RUNNING, job.id)
            pipe.delete(keys.job_lease(job.id))
            pipe.execute()
        status = job.record.status
        if status == FINISHED:
            self._rq_success(job)
        elif status == CANCELLED:
            self._rq_cancelled(job.rq_job, job.queue)
        else:
            self._rq_failure(job.rq_job, job.queue, "the job had already ended")

    def _cancel_queued(self, job_id: str, rq_job: Job | None, queue: Queue) -> None:
        """Its cancel flag was set while it waited: it never runs. No worker holds it (the
        claim gave no lease), so the write needs no fence."""
        with self.connection.pipeline() as pipe:
            write_ending(pipe, job_id, CANCELLED, cancelled_error())
            pipe.execute()
        log.info("job %s: cancelled before it started", job_id)
        self._rq_cancelled(rq_job, queue)

    def _fail_orphan(self, rq_job: Job | None, queue: Queue, why: str) -> None:
        if rq_job is None:
            return
        refusal = _refusal(rq_job, rq_job.id)
        message = str(refusal) if refusal else why
        log.error("job %s: not run: %s", rq_job.id, message)
        self._count(FAILED)
        self._rq_failure(rq_job, queue, message)

    # ------------------------------------------------------------------ leases

    @property
    def _lease_ms(self) -> int:
        return int(self.config.lease_ttl * 1000)

    def _renew_leases(self) -> None:
        jobs = list(self.batcher.jobs.values())
        if not jobs:
            return
        with self.connection.pipeline(transaction=False) as pipe:
            for job in jobs:
                scripts.renew(pipe, job.id, job.lease, self._lease_ms)
            renewed = pipe.execute()
        for job, ok in zip(jobs, renewed, strict=True):
            if not ok:
                self._drop(job)

    def _checkpoint(self, job: ActiveJob) -> None:
        """Give a running job back: requeued at the front, resumed from its stream."""
        self.batcher.remove(job)
        self.forget_execution(job.id)
        if job.rq_job is not None and requeue(self.connection, job.id, job.lease, job.rq_job):
            log.info(
                "job %s: checkpointed after %d tokens and requeued", job.id, job.completion_tokens
            )
            with self.connection.pipeline() as pipe:
                metrics.count_job(pipe, "requeued")
                pipe.execute()
        self.sync_state()

    def _release_own_queues(self) -> None:
        """Jobs routed to this worker's own queues go back to the shared ones (it is leaving)."""
        for name in self.queue_names():
            if keys.queue_owner(name) == self.name:
                moved = affinity.release(self.connection, name)
                if moved:
                    log.info(
                        "worker %s: moved %d job(s) from %s to the shared queue",
                        self.name,
                        moved,
                        name,
                    )

    def _checkpoint_all(self) -> None:
        if self._has_output():
            self._flush()
        for job in list(self.batcher.jobs.values()):
            self._checkpoint(job)

    def _shutdown(self) -> None:
        try:
            if self.batcher.jobs:
                self._checkpoint_all()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.error(
                "worker %s: could not checkpoint (%s); the reaper will requeue", self.name, exc
            )
        self.pool.close()
        try:
            self.presence.withdraw()
            self._release_own_queues()
            self.teardown()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.error("worker %s: could not unregister (%s)", self.name, exc)
        log.info("worker %s: stopped", self.name)

    # ------------------------------------------------------------------ RQ and our record

    def _rq_start(self, job: ActiveJob) -> None:
        """RQ's start of an execution (one of several this worker has open), and ours."""
        with self.connection.pipeline() as pipe:
            if job.rq_job is not None:
                self.open_execution(job.rq_job, pipe)
            pipe.hset(keys.job(job.id), mapping={"status": STARTED, "worker": self.name})
            pipe.hsetnx(keys.job(job.id), "started_at", time.time())
            metrics.count_job(pipe, "started")
            if job.model in self._own_models:
                affinity.remember_start(pipe, self.name, job.record)
            pipe.execute()
        self.sync_state()

    # The three `_rq_*` only close RQ's execution: a job's end is counted in `METRIC_JOBS` by
    # the write that ends it (`scripts.append`), or by `_count` where there is none.

    def _rq_success(self, job: ActiveJob) -> None:
        if job.rq_job is not None:  # RQ keeps a stub result: the body stays in our record
            self.close_success(job.rq_job, job.queue, {"job_id": job.id, "status": FINISHED})

    def _rq_failure(self, rq_job: Job | None, queue: Queue, message: str) -> None:
        if rq_job is not None:
            self.close_failure(rq_job, queue, message)

    def _rq_cancelled(self, rq_job: Job | None, queue: Queue) -> None:
        if rq_job is not None:
            self.close_cancelled(rq_job, queue)

    def _count(self, state: str) -> None:
        with self.connection.pipeline() as pipe:
            metrics.count_job(pipe, state)
            pipe.execute()

    # ------------------------------------------------------------------ presence, admin

    def _publish(self) -> None:
        for model in self.pool.sources:
            entry = self.pool.get(model)
            if entry is not None and entry.engine is not None and model in self.presence.models:
                self.presence.models[model]["context_length"] = entry.engine.context_length
        if self._stop_now or self._drain_deadline is not None:
            state = "stopping"
        else:
            state = "busy" if self.batcher.jobs else "idle"
        self.presence.publish(state, list(self.batcher.jobs), self.pool.snapshot())
        rate = self._throughput.rate()
        self.connection.hset(keys.METRIC_TOKENS_PER_SECOND, self.name, f"{rate:.2f}")

    def _handle_commands(self, commands: list[tuple[str, str]]) -> None:
        for op, model in commands:
            log.info("worker %s: admin command %s %s", self.name, op, model)
            try:
                if op == COMMAND_LOAD:
                    self.pool.request(model)
                else:
                    self.pool.unload(model)
            except (JobFailure, PoolFull) as exc:
                log.warning("worker %s: cannot %s %s: %s", self.name, op, model, exc)


def _refusal(rq_job: Job | None, job_id: str) -> JobRefused | None:
    """Why an RQ entry must not run (RELIABILITY F19), or None if it is an llmq job."""
    if rq_job is None:
        return JobRefused(f"job {job_id} has no readable RQ job (not JSON-serialized?)")
    try:
        func_name, args, kwargs = rq_job.func_name, list(rq_job.args), rq_job.kwargs
    except Exception:
        return JobRefused(f"job {job_id}: its RQ data is not JSON; only {JOB_FUNCTION} runs")
    if func_name != JOB_FUNCTION:
        return JobRefused(f"job {job_id} calls {func_name!r}; only {JOB_FUNCTION} may run here")
    if args != [job_id] or kwargs:
        return JobRefused(f"job {job_id}: {JOB_FUNCTION} takes exactly its job id as argument")
    return None


def _describe_models(sources: dict[str, str]) -> dict[str, dict[str, Any]]:
    described = {
        spec.id: {"id": spec.id, "source": spec.source, "owned_by": "llmq"}
        for spec in load_registry().values()
    }
    for model, source in sources.items():
        described.setdefault(model, {"id": model, "source": source, "owned_by": "llmq"})
    return described
