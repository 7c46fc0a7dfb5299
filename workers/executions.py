"""RQ's bookkeeping for a worker that has several jobs running at once.

RQ's `BaseWorker` assumes one job at a time: it keeps the open `Execution` in
`self.execution` and its success/failure handlers close that one. `ConcurrentWorker` keeps
one open execution per running job and points `self.execution` at the right one around
RQ's own `handle_job_success` / `handle_job_failure`, so every job still gets RQ's
standard treatment: an entry in the StartedJobRegistry while it runs (refreshed by
`heartbeat_executions`), then the Finished/Failed/Canceled registry, a Result, and the
worker's counters. RQ shows one `current_job` per worker: the oldest one running.
"""

from __future__ import annotations

from typing import Any

from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.utils import now
from rq.worker import BaseWorker, WorkerStatus
from rq.worker_registration import register


class ConcurrentWorker(BaseWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._executions: dict[str, tuple[Execution, Job]] = {}

    @property
    def execution_ttl(self) -> int:
        return self.job_monitoring_interval + 60

    def open_execution(self, rq_job: Job, pipe: Any) -> None:
        """Start an execution of `rq_job` (status started, StartedJobRegistry) in `pipe`."""
        execution = Execution.create(rq_job, self.execution_ttl, pipe, self.name)
        rq_job.prepare_for_execution(self.name, pipe)
        self._executions[rq_job.id] = (execution, rq_job)

    def close_success(self, rq_job: Job, queue: Queue, result: Any) -> None:
        self._close(
            rq_job,
            lambda: self.handle_job_success(rq_job, queue, queue.started_job_registry),
            result,
        )

    def close_failure(self, rq_job: Job, queue: Queue, message: str) -> None:
        rq_job.retries_left = None  # RQ's retries would re-run a job we failed on purpose
        self._close(rq_job, lambda: self.handle_job_failure(rq_job, queue, exc_string=message))

    def close_cancelled(self, rq_job: Job, queue: Queue) -> None:
        opened = self._executions.pop(rq_job.id, None)
        with self.connection.pipeline() as pipe:
            if opened is not None:
                opened[0].delete(job=rq_job, pipeline=pipe)
            rq_job.set_status(JobStatus.CANCELED, pipeline=pipe)
            queue.canceled_job_registry.add(rq_job, pipeline=pipe)
            pipe.execute()
        self.sync_state()

    def forget_execution(self, job_id: str) -> None:
        """The job is someone else's now; whoever took it over cleans RQ's records."""
        self._executions.pop(job_id, None)

    def sync_state(self) -> None:
        current = next(iter(self._executions), None)
        with self.connection.pipeline() as pipe:
            self.set_current_job_id(current, pipeline=pipe)
            self.set_state(WorkerStatus.BUSY if current else WorkerStatus.IDLE, pipeline=pipe)
            pipe.execute()

    def heartbeat_executions(self) -> None:
        """The worker's heartbeat and every open execution's, in one round trip; a worker
        hash that Redis lost (a restart without persistence) is registered again."""
        with self.connection.pipeline() as pipe:
            pipe.exists(self.key)
            self.heartbeat(pipeline=pipe)
            for execution, rq_job in self._executions.values():
                execution.heartbeat(rq_job.started_job_registry, self.execution_ttl, pipe)
            existed = pipe.execute()[0]
        if not existed:
            with self.connection.pipeline() as pipe:
                pipe.hset(self.key, mapping=self.serialize())
                pipe.hset(self.key, "state", self.get_state())
                register(self, pipe)
                pipe.execute()

    def _close(self, rq_job: Job, handle: Any, result: Any = None) -> None:
        opened = self._executions.pop(rq_job.id, None)
        self.execution = opened[0] if opened else None
        rq_job.ended_at = now()
        rq_job.started_at = rq_job.started_at or rq_job.ended_at
        rq_job._result = result
        try:
            handle()
        finally:
            self.execution = None
            self.sync_state()
