"""RQ's view of the jobs an `LLMQWorker` runs: fetching RQ jobs, refusing entries that
are not llmq jobs (RELIABILITY F19), and opening and closing RQ executions (several at once,
`workers.executions`) so `rq info` and RQ's registries agree with our records.

The `_rq_*` closers only close RQ's execution: a job's end is counted in `METRIC_JOBS` by
the write that ends it (`scripts.append`), or by `_count` where there is none.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from workers import affinity, keys, metrics
from workers.errors import JobRefused
from workers.executions import ConcurrentWorker
from workers.jobs import ActiveJob
from workers.wire.defaults import JOB_TTL_SECONDS
from workers.wire.job import FINISHED, JOB_FUNCTION, STARTED

if TYPE_CHECKING:
    from workers.running import RunningJobs

log = logging.getLogger("llmq.worker")

REDIS_SOCKET_TIMEOUT = 5


class RQBookkeeping(ConcurrentWorker):
    """The RQ worker underneath `LLMQWorker`: its overrides and its bookkeeping."""

    running: RunningJobs
    _own_models: set[str]

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
        if payload.get("command") == "stop-job" and payload.get("job_id") in self.running.jobs:
            self.connection.set(keys.job_cancel(payload["job_id"]), "1", ex=JOB_TTL_SECONDS)
            return
        super().handle_payload(message)


def refusal(rq_job: Job | None, job_id: str) -> JobRefused | None:
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
