"""A worker's leases on the jobs it runs: how long one lasts, its name, and its renewal.

A lease (`keys.job_lease`) is "{worker}:{attempt}" with a short TTL; every write for a job
is fenced on it (`scripts.append`), so a worker that stalled past its lease, whose job
another worker now runs, writes nothing more (docs/faults.md, F12). The reaper
(`workers.recovery`) requeues running jobs whose lease expired.
"""

from __future__ import annotations

from collections.abc import Iterable

from workers.event_store import Events
from workers.jobs import ActiveJob


class Leases:
    def __init__(self, events: Events, worker_name: str, ttl_seconds: float) -> None:
        """`events`: where the leases are (`workers.event_store`, built once by whoever
        started the process)."""
        self.events = events
        self.worker = worker_name
        self.ttl_ms = int(ttl_seconds * 1000)

    def name(self, attempt: int) -> str:
        """The lease this worker holds on the `attempt`-th run of a job it claimed."""
        return f"{self.worker}:{attempt}"

    def renew(self, jobs: Iterable[ActiveJob]) -> list[ActiveJob]:
        """Renew every job's lease in one round trip; the jobs whose lease is not ours any
        more (another worker runs them now)."""
        jobs = list(jobs)
        if not jobs:
            return []
        renewed = self.events.renew([(job.id, job.lease) for job in jobs], self.ttl_ms)
        return [job for job, ok in zip(jobs, renewed, strict=True) if not ok]
