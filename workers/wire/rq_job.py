"""RQ's record of a job that llmq pushes onto a queue itself.

The API's submission gate (`api.gate`) and the batch driver (`workers.batches`) put job ids
on the list a job's priority waits on (`keys.level_queue_name`), which RQ's `enqueue` cannot
choose; so both build RQ's hash with RQ's public `Job.create` and push the id themselves, and
`rq info` and rq-dashboard read the job like any other. Its only argument is the job id: the
request stays in our record (docs/faults.md, F17).
"""

from __future__ import annotations

from typing import Any

from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer
from rq.utils import now as rq_now

from workers.wire.defaults import JOB_TTL_SECONDS
from workers.wire.job import JOB_FUNCTION

RQ_JOB_TIMEOUT_SECONDS = 3600  # a generation longer than this is a bug, not a workload


def write_queued_rq_job(pipe: Any, conn: Any, job_id: str, origin: str) -> None:
    """Queue on `pipe` the writes of RQ's job for `job_id`, queued on the shared queue
    `origin` and expiring with our record; the caller pushes the id."""
    job = Job.create(
        JOB_FUNCTION,
        args=[job_id],
        connection=conn,
        id=job_id,
        description=job_id,  # RQ logs this; never the prompt (docs/faults.md L9)
        timeout=RQ_JOB_TIMEOUT_SECONDS,
        ttl=JOB_TTL_SECONDS,
        result_ttl=JOB_TTL_SECONDS,
        failure_ttl=JOB_TTL_SECONDS,
        origin=origin,
        status=JobStatus.QUEUED,
        serializer=JSONSerializer,
    )
    job.enqueued_at = rq_now()
    job.save(pipeline=pipe)
    job.cleanup(ttl=JOB_TTL_SECONDS, pipeline=pipe)  # RQ's hash expires with ours
