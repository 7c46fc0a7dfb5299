"""Taking jobs off queues and giving them back, atomically (`scripts.claim`, `recovery.requeue`).

A claim pops a job id, marks it running and takes its lease in one script, so a worker that
dies between the two loses nothing: the reaper finds the job running without a lease.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workers import scripts
from workers.event_store import Events
from workers.jobs import ActiveJob
from workers.leases import Leases
from workers.recovery import requeue

MISSING = scripts.CLAIMED_MISSING  # the job's record is gone
CANCELLED = scripts.CLAIMED_CANCELLED  # its cancel flag was set while it was queued


@dataclass(frozen=True)
class Claim:
    """A job taken off `queue_keys[queue_index]`; `attempt` is its run number (>= 1) or
    `MISSING` / `CANCELLED` (then no lease was taken and it must not run)."""

    queue_index: int
    job_id: str
    attempt: int


class Claims:
    def __init__(self, connection: Any, leases: Leases, events: Events) -> None:
        self.connection = connection
        self.leases = leases
        self.events = events  # where leases live

    def take(
        self, queue_keys: Sequence[str], kind_ranks: Sequence[int] | None = None
    ) -> Claim | None:
        """The job that comes first by (kind rank, priority, place in `queue_keys`) on the
        queues and their priority levels, or None (no ranks: all rank alike)."""
        claimed = self.events.claim(queue_keys, self.leases, kind_ranks)
        return None if claimed is None else Claim(*claimed)

    def give_back(self, job: ActiveJob) -> bool:
        """Requeue a running job at the front of its queue (drain, no room), to be resumed
        from its stream; False if its lease was not ours any more."""
        if job.rq_job is None:
            return False
        return requeue(self.connection, job.id, job.lease, job.rq_job, self.events)
