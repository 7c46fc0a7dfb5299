"""Getting a job whose worker died back on its queue, fast (docs/faults.md).

RQ alone notices a dead worker's job only after its StartedJobRegistry entry expires (a
minute or more) and then fails it. Here every running job has a short lease; a reaper in
every worker looks every couple of seconds for jobs in `keys.RUNNING` without a lease, takes
the lease itself (so exactly one reaper recovers each job), clears RQ's record of the dead
execution and puts the job back at the front of its queue, where the next worker resumes
it from its event stream. A worker that checkpoints its own jobs on shutdown uses the same
`requeue`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from rq.exceptions import NoSuchJobError
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from workers import affinity, keys, metrics, scripts
from workers.event_store import Events
from workers.presence import wake
from workers.wire.errors import error_body
from workers.wire.job import FAILED, TERMINAL_STATUSES

log = logging.getLogger("llmq.recovery")


def clear_started(pipe: Any, connection: Any, rq_job: Job) -> None:
    """Remove every execution of `rq_job` from RQ's started registry and its execution keys.

    Entries are found by job id rather than through `Execution.fetch`, which fails once a
    dead worker's execution hash has expired.
    """
    registry = rq_job.started_job_registry
    prefix = f"{rq_job.id}:".encode()
    stale = [e for e in connection.zrange(registry.key, 0, -1) if e.startswith(prefix)]
    if stale:
        pipe.zrem(registry.key, *stale)
    executions = rq_job.execution_registry
    for execution_id in connection.zrange(executions.key, 0, -1):
        pipe.delete(Execution(execution_id.decode(), rq_job.id, connection).key)
    pipe.delete(executions.key)


def requeue(connection: Any, job_id: str, lease: str, rq_job: Job, events: Events) -> bool:
    """Put a job that holds `lease` back at the front of its queue; False if the lease was
    no longer `lease` (someone else owns the job now). Where the lease is (`events`,
    `workers.event_store`) says who checks it and gives it up: the requeue script itself on
    the queue Redis, the events cluster before and after it."""
    fence = events.requeue_fence(job_id, lease)
    if fence is None:
        return False
    with connection.pipeline() as pipe:
        clear_started(pipe, connection, rq_job)
        rq_job.failed_job_registry.remove(rq_job, pipeline=pipe)  # RQ may have given up on it
        pipe.execute()
    queue_key = Queue(rq_job.origin, connection=connection).key
    if not scripts.requeue(connection, job_id, fence, queue_key, rq_job.key):
        return False
    events.after_requeue(job_id, lease)
    wake(connection, rq_job.origin)  # an idle worker resumes it now, not at its next poll
    return True


class Reaper:
    """Finds running jobs whose lease expired and requeues them; with the events on a
    cluster, one whose stream already ends (its worker died between its final events and
    its record's end, `workers.cluster_step`) is finished from its stream instead."""

    def __init__(self, connection: Any, worker_name: str, lease_ms: int, events: Events) -> None:
        self.connection = connection
        self.events = events  # where leases live
        self.worker = worker_name
        self.lease = f"reaper:{worker_name}"
        self.lease_ms = lease_ms

    def release_queues(self) -> dict[str, int]:
        """Move the jobs waiting on the own queue of a worker that will not run them (dead,
        draining) to the shared queue: queue name -> jobs moved."""
        return affinity.release_orphaned(self.connection, self.worker)

    def run(self) -> list[str]:
        """One sweep; the ids of the jobs it requeued."""
        recovered = []
        for job_id, has_lease in self.events.leases_of_running():
            if has_lease:
                continue
            lease_key = keys.job_lease(job_id)
            if not self.events.client.set(lease_key, self.lease, nx=True, px=self.lease_ms):
                continue  # another reaper (or a claim) got there first
            if not self.connection.sismember(keys.RUNNING, job_id):
                # another reaper requeued it since this sweep looked: RQ's records are
                # the next run's now (`scripts.requeue` would refuse it too)
                scripts.give_up(self.events.client, job_id, self.lease)
                continue
            if self._recover(job_id):
                recovered.append(job_id)
        return recovered

    def _recover(self, job_id: str) -> bool:
        status = self.connection.hget(keys.job(job_id), "status")
        if status is None or status.decode() in TERMINAL_STATUSES:
            self._forget(job_id, lost=status is None)
            return False
        ended = self.events.finish_from_stream(job_id)
        if ended is not None:
            scripts.give_up(self.events.client, job_id, self.lease)
            log.warning("job %s: its worker died after its end; record %s", job_id, ended)
            return False
        try:
            rq_job = Job.fetch(job_id, connection=self.connection, serializer=JSONSerializer)
        except NoSuchJobError:
            self._forget(job_id, lost=True)
            return False
        if requeue(self.connection, job_id, self.lease, rq_job, self.events):
            log.warning("job %s lost its worker (lease expired); requeued to resume", job_id)
            return True
        return False

    def _forget(self, job_id: str, lost: bool) -> None:
        """A running entry with nothing to resume: fail the record if it still exists."""
        with self.connection.pipeline() as pipe:
            if lost and self.connection.exists(keys.job(job_id)):
                body = error_body("the job was lost by its worker", "server_error", status=500)
                pipe.hset(
                    keys.job(job_id),
                    mapping={
                        "status": FAILED,
                        "error": json.dumps(body),
                        "finished_at": time.time(),
                    },
                )
                metrics.count_job(pipe, FAILED)
            pipe.srem(keys.RUNNING, job_id)
            pipe.execute()
        self.events.drop_lease(job_id)
        log.warning("job %s was running without a worker and cannot resume; dropped", job_id)
