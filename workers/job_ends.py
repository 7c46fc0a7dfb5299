"""What each way a job can leave a worker means, for every collaborator that knows of it.

A job leaves its worker finished, failed, cancelled, dropped (its lease is another
worker's), checkpointed (given back to be resumed elsewhere), or before it ever ran
(cancelled or orphaned while queued, or found already ended). Each end takes the job out
of `RunningJobs`, writes what only the lease holder may write (`EventWriter`, fenced), and
then closes RQ's execution (`RQRegistries`), in that order: RQ's side never says a job
ended before its stream does.
"""

from __future__ import annotations

import logging
from typing import Any

from rq.job import Job
from rq.queue import Queue

from workers import keys
from workers.claims import Claims
from workers.errors import JobFailure
from workers.event_writer import EventWriter
from workers.jobs import ActiveJob
from workers.rq_registries import RQRegistries, refusal
from workers.running import RunningJobs
from workers.wire.errors import cancelled_error
from workers.wire.job import CANCELLED, FAILED, FINISHED

log = logging.getLogger("llmq.worker")


class JobEnds:
    def __init__(
        self,
        connection: Any,
        running: RunningJobs,
        writer: EventWriter,
        rq: RQRegistries,
        claims: Claims,
    ) -> None:
        self.connection = connection
        self.running = running
        self.writer = writer
        self.rq = rq
        self.claims = claims

    def finished(self, job: ActiveJob) -> None:
        """Its final write landed (`EventWriter.flush`)."""
        self.running.remove(job)
        log.info("job %s: finished (%d completion tokens)", job.id, job.completion_tokens)
        self._rq_success(job)

    def fail(self, job: ActiveJob, failure: JobFailure) -> None:
        log.warning("job %s: failed with %d: %s", job.id, failure.status, failure)
        if self._end(job, FAILED, failure.body()) and job.rq_job is not None:
            self.rq.close_failure(job.rq_job, job.queue, f"{type(failure).__name__}: {failure}")

    def cancel(self, job: ActiveJob) -> None:
        log.info("job %s: cancelled after %d tokens", job.id, job.completion_tokens)
        if self._end(job, CANCELLED, cancelled_error()) and job.rq_job is not None:
            self.rq.close_cancelled(job.rq_job, job.queue)

    def drop(self, job: ActiveJob) -> None:
        """The job is not ours any more (lease lost): stop it without writing anything."""
        log.warning("job %s: lease lost (another worker owns it now); dropped", job.id)
        self.running.remove(job)
        self.rq.forget(job.id)
        self.rq.sync_state()

    def checkpoint(self, job: ActiveJob) -> None:
        """Give a running job back: requeued at the front, resumed from its stream."""
        self.running.remove(job)
        self.rq.forget(job.id)
        if self.claims.give_back(job):
            log.info(
                "job %s: checkpointed after %d tokens and requeued", job.id, job.completion_tokens
            )
            self.writer.count_job("requeued")
        self.rq.sync_state()

    def settle_ended(self, job: ActiveJob) -> None:
        """A claimed job that had already ended (an earlier worker died between its final
        write and RQ's bookkeeping): give the claim back and make RQ agree. Its end was
        counted by the write that ended it."""
        self.connection.srem(keys.RUNNING, job.id)
        self.writer.events.drop_lease(job.id)
        status = job.record.status
        if status == FINISHED:
            self._rq_success(job)
        elif job.rq_job is None:
            return
        elif status == CANCELLED:
            self.rq.close_cancelled(job.rq_job, job.queue)
        else:
            self.rq.close_failure(job.rq_job, job.queue, "the job had already ended")

    def cancel_queued(self, job_id: str, rq_job: Job | None, queue: Queue) -> None:
        """Its cancel flag was set while it waited: it never runs."""
        self.writer.cancel_unclaimed(job_id)
        log.info("job %s: cancelled before it started", job_id)
        if rq_job is not None:
            self.rq.close_cancelled(rq_job, queue)

    def fail_orphan(self, rq_job: Job | None, queue: Queue, why: str) -> None:
        """A queued id whose record is gone: RQ's side fails, with why."""
        if rq_job is None:
            return
        refused = refusal(rq_job, rq_job.id)
        message = str(refused) if refused else why
        log.error("job %s: not run: %s", rq_job.id, message)
        self.writer.count_job(FAILED)
        self.rq.close_failure(rq_job, queue, message)

    def _end(self, job: ActiveJob, status: str, body: dict[str, Any]) -> bool:
        """Stop the job and write its end (fenced); False if it was not ours any more."""
        self.running.remove(job)
        if self.writer.end(job, status, body):
            return True
        self.drop(job)
        return False

    def _rq_success(self, job: ActiveJob) -> None:
        if job.rq_job is not None:  # RQ keeps a stub result: the body stays in our record
            self.rq.close_success(job.rq_job, job.queue, {"job_id": job.id, "status": FINISHED})
