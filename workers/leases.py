"""A worker's leases on the jobs it runs: how long one lasts, its name, and its renewal.

A lease (`keys.job_lease`) is "{worker}:{attempt}" with a short TTL; every write for a job
is fenced on it (`scripts.append`), so a worker that stalled past its lease, whose job
another worker now runs, writes nothing more (docs/faults.md, F12). The reaper
(`workers.recovery`) requeues running jobs whose lease expired.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from workers import cluster_step, keys, scripts
from workers.jobs import ActiveJob
from workers.wire.broker import is_cluster


class Leases:
    def __init__(self, connection: Any, worker_name: str, ttl_seconds: float) -> None:
        self.connection = connection
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
        if is_cluster(self.connection):  # leases on the events cluster: per node
            calls = [([keys.job_lease(j.id)], [j.lease, self.ttl_ms]) for j in jobs]
            renewed = cluster_step.per_node(self.connection, scripts.RENEW, calls)
            return [job for job, ok in zip(jobs, renewed, strict=True) if not ok]
        with self.connection.pipeline(transaction=False) as pipe:
            for job in jobs:
                scripts.renew(pipe, job_id=job.id, lease=job.lease, lease_ms=self.ttl_ms)
            renewed = pipe.execute()
        return [job for job, ok in zip(jobs, renewed, strict=True) if not ok]
