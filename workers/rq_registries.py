"""RQ's view of the jobs an `LLMQWorker` runs, kept true through RQ's public API only.

RQ's own workers run one job at a time: their success/failure handlers close the one
execution the worker holds. An llmq worker has several jobs running at once and claims them
with its own Lua (`workers.claims`), so it opens and closes each job's RQ `Execution` itself,
with the calls RQ documents for jobs, registries and results: every job gets an entry in the
StartedJobRegistry while it runs (refreshed by `heartbeat`), then the Finished, Failed or
Canceled registry, a `Result`, and the worker's counters, so `rq info` and rq-dashboard agree
with our records. RQ shows one `current_job` per worker: the oldest one running.

The closers only close RQ's side: a job's end is counted in `keys.METRIC_JOBS` by the write
that ends it (`scripts.append`), or by `EventWriter.count_job` where there is none.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import redis
from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.results import Result
from rq.serializers import JSONSerializer
from rq.utils import now
from rq.worker import BaseWorker, WorkerStatus
from rq.worker_registration import register

from workers import keys
from workers.errors import JobRefused
from workers.wire.job import JOB_FUNCTION

log = logging.getLogger("llmq.worker")

REDIS_SOCKET_TIMEOUT = 5
RQ_WORKER_TTL = 20  # RQ's worker hash lives this + 60 s past the last heartbeat
RQ_MONITORING_INTERVAL = 10  # open executions' StartedJobRegistry scores are refreshed this often


class RQWorker(BaseWorker):
    """The worker as RQ knows it: registered (`rq info` lists it and its queues), with a
    heartbeat and RQ's pub/sub commands. It never runs RQ's job loop; `LLMQWorker` does."""

    log_result_lifespan = False

    def __init__(self, *args: Any, on_stop_job: Callable[[str], bool], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_stop_job = on_stop_job  # True if it was one of ours (then it is handled)

    @property
    def connection_timeout(self) -> int:
        return REDIS_SOCKET_TIMEOUT  # RQ's default (minutes) would hide a dead Redis

    def handle_payload(self, message: dict[str, Any]) -> None:
        """RQ's pub/sub commands: `stop-job` becomes our cancel flag (a non-forking worker
        has no horse to kill); `shutdown` arrives as SIGINT through RQ's own handler."""
        try:
            payload = json.loads(message["data"].decode())
        except (ValueError, KeyError, AttributeError):
            return
        if payload.get("command") == "stop-job" and self.on_stop_job(str(payload.get("job_id"))):
            return
        super().handle_payload(message)


class RQRegistries:
    """Opens and closes the RQ executions of the jobs one worker runs (several at once)."""

    def __init__(self, worker: RQWorker) -> None:
        self.worker = worker
        self.connection: redis.Redis = worker.connection
        self.closed = 0  # executions closed (finished, failed or cancelled) by this worker
        self._open: dict[str, tuple[Execution, Job]] = {}  # job id -> its open execution

    @property
    def execution_ttl(self) -> int:
        return self.worker.job_monitoring_interval + 60

    def queue(self, queue: Queue) -> Queue:
        """The queue RQ files a job under: a worker's own queue's jobs belong to the shared
        queue (their origin)."""
        if keys.queue_owner(queue.name) is None:
            return queue
        shared = keys.shared_queue_name(queue.name)
        return Queue(shared, connection=self.connection, serializer=JSONSerializer)

    def fetch(self, job_id: str) -> Job | None:
        try:
            return Job.fetch(job_id, connection=self.connection, serializer=JSONSerializer)
        except NoSuchJobError:
            return None
        except Exception:  # an entry that is not an RQ job we can read
            log.error("job %s: its RQ job cannot be read", job_id)
            return None

    def open(self, rq_job: Job, pipe: Any) -> None:
        """Start an execution of `rq_job` in `pipe`: status started, StartedJobRegistry."""
        execution = Execution.create(rq_job, self.execution_ttl, pipe, self.worker.name)
        rq_job.worker_name = self.worker.name
        rq_job.started_at = rq_job.last_heartbeat = now()
        rq_job.set_status(JobStatus.STARTED, pipeline=pipe)
        rq_job.save(pipeline=pipe, include_meta=False, include_result=False)
        self._open[rq_job.id] = (execution, rq_job)

    def close_success(self, rq_job: Job, queue: Queue, result: Any) -> None:
        """Finished: a Result holding `result`, the FinishedJobRegistry, the worker's
        counters. (llmq jobs have no dependents, no repeats and no webhooks.)"""
        execution = self._ended(rq_job)
        ttl = rq_job.get_result_ttl(self.worker.default_result_ttl)
        with self.connection.pipeline() as pipe:
            self._close_execution(execution, rq_job, pipe)
            rq_job.set_status(JobStatus.FINISHED, pipeline=pipe)
            rq_job.save(pipeline=pipe, include_meta=False, include_result=False)
            if ttl != 0:
                Result.create(
                    rq_job,
                    Result.Type.SUCCESSFUL,
                    ttl,
                    return_value=result,
                    worker_name=self.worker.name,
                    pipeline=pipe,
                    **_execution_fields(execution, rq_job),
                )
                queue.finished_job_registry.add(rq_job, ttl, pipe)
            rq_job.cleanup(ttl, pipeline=pipe, remove_from_queue=False)  # RQ's hash expires
            self.worker.increment_successful_job_count(pipeline=pipe)
            self._working_time(rq_job, pipe)
            pipe.execute()
        self._after_close()

    def close_failure(self, rq_job: Job, queue: Queue, message: str) -> None:
        """Failed, never retried by RQ (a job we fail is failed on purpose): the
        FailedJobRegistry with `message`, a failure Result, the worker's counters."""
        execution = self._ended(rq_job)
        with self.connection.pipeline() as pipe:
            self._close_execution(execution, rq_job, pipe)
            rq_job.set_status(JobStatus.FAILED, pipeline=pipe)
            queue.failed_job_registry.add(
                rq_job, ttl=rq_job.failure_ttl, exc_string=message, pipeline=pipe
            )
            Result.create_failure(
                rq_job,
                rq_job.failure_ttl,
                message,
                worker_name=self.worker.name,
                pipeline=pipe,
                **_execution_fields(execution, rq_job),
            )
            self.worker.increment_failed_job_count(pipeline=pipe)
            self._working_time(rq_job, pipe)
            pipe.execute()
        self._after_close()

    def close_cancelled(self, rq_job: Job, queue: Queue) -> None:
        execution = self._open.pop(rq_job.id, (None, None))[0]
        with self.connection.pipeline() as pipe:
            self._close_execution(execution, rq_job, pipe)
            rq_job.set_status(JobStatus.CANCELED, pipeline=pipe)
            queue.canceled_job_registry.add(rq_job, pipeline=pipe)
            pipe.execute()
        self._after_close()

    def forget(self, job_id: str) -> None:
        """The job is someone else's now; whoever took it over cleans RQ's records."""
        self._open.pop(job_id, None)

    def sync_state(self) -> None:
        """RQ's `state` and `current_job` of this worker, from its open executions."""
        current = next(iter(self._open), None)
        with self.connection.pipeline() as pipe:
            self.worker.set_current_job_id(current, pipeline=pipe)
            state = WorkerStatus.BUSY if current else WorkerStatus.IDLE
            self.worker.set_state(state, pipeline=pipe)
            pipe.execute()

    def heartbeat(self) -> None:
        """The worker's heartbeat and every open execution's, in one round trip; a worker
        hash that Redis lost (a restart without persistence) is registered again."""
        with self.connection.pipeline() as pipe:
            pipe.exists(self.worker.key)
            self.worker.heartbeat(pipeline=pipe)
            for execution, rq_job in self._open.values():
                execution.heartbeat(rq_job.started_job_registry, self.execution_ttl, pipe)
            existed = pipe.execute()[0]
        if not existed:
            with self.connection.pipeline() as pipe:
                pipe.hset(self.worker.key, mapping=self.worker.serialize())
                pipe.hset(self.worker.key, "state", self.worker.get_state())
                register(self.worker, pipe)
                pipe.execute()

    def _ended(self, rq_job: Job) -> Execution | None:
        execution = self._open.pop(rq_job.id, (None, None))[0]
        rq_job.ended_at = now()
        rq_job.started_at = rq_job.started_at or rq_job.ended_at
        return execution

    def _close_execution(self, execution: Execution | None, rq_job: Job, pipe: Any) -> None:
        if execution is not None:
            execution.delete(job=rq_job, pipeline=pipe)

    def _working_time(self, rq_job: Job, pipe: Any) -> None:
        if rq_job.started_at and rq_job.ended_at:
            self.worker.increment_total_working_time(rq_job.ended_at - rq_job.started_at, pipe)

    def _after_close(self) -> None:
        self.closed += 1
        self.sync_state()


def _execution_fields(execution: Execution | None, rq_job: Job) -> dict[str, Any]:
    return {
        "execution_id": execution.id if execution else None,
        "execution_started_at": execution.created_at if execution else None,
        "execution_ended_at": rq_job.ended_at,
    }


def refusal(rq_job: Job | None, job_id: str) -> JobRefused | None:
    """Why an RQ entry must not run (docs/faults.md, F19), or None if it is an llmq job."""
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
