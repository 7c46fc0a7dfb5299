"""The worker's writes for the jobs it runs: every one fenced by the job's lease.

A step's new token events, finished jobs' results and metrics go out in one pipeline
(`_flush`), each job's events through `scripts.append`, which writes nothing once the lease
is another worker's (then the job is dropped here without a word). Failed and cancelled
jobs end through `_end`; a job nobody holds a lease on ends through
`wire.events.write_ending`. Leases are renewed here, and a job given back (drain, no room)
is checkpointed: requeued at the front, resumed from its stream by the next worker.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import redis
from rq.job import Job
from rq.queue import Queue

from workers import affinity, keys, metrics, scripts
from workers.errors import JobFailure
from workers.jobs import ActiveJob
from workers.recovery import requeue
from workers.rq_bookkeeping import refusal
from workers.wire.defaults import JOB_TTL_SECONDS
from workers.wire.errors import cancelled_error
from workers.wire.events import ending, write_ending
from workers.wire.job import CANCELLED, FAILED, FINISHED

if TYPE_CHECKING:
    from workers.config import WorkerConfig
    from workers.running import RunningJobs

log = logging.getLogger("llmq.worker")


class JobWrites:
    """Mixin of `LLMQWorker`: fenced writes, ends of jobs, leases and checkpoints."""

    name: str
    connection: redis.Redis
    config: WorkerConfig
    running: RunningJobs
    _own_models: set[str]
    _throughput: metrics.Throughput

    def _has_output(self) -> bool:
        return any(j.pending or j.result is not None for j in self.running.jobs.values())

    def _flush(self, step: bool = False) -> None:
        """One round trip: every job's new events (fenced), finished jobs' results, metrics,
        and every running job's cancel flag."""
        jobs = list(self.running.jobs.values())
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
            if flagged and job.id in self.running.jobs:
                self._cancel(job)

    def _record_metrics(self, pipe: Any, writes: list, tokens: dict[str, int], step: bool) -> None:
        if step:
            metrics.record_step(pipe, self.running.last_step_sizes, tokens)
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
        self.running.remove(job)
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
        self.running.remove(job)
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
        self.running.remove(job)
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
        refused = refusal(rq_job, rq_job.id)
        message = str(refused) if refused else why
        log.error("job %s: not run: %s", rq_job.id, message)
        self._count(FAILED)
        self._rq_failure(rq_job, queue, message)

    @property
    def _lease_ms(self) -> int:
        return int(self.config.lease_ttl * 1000)

    def _renew_leases(self) -> None:
        jobs = list(self.running.jobs.values())
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
        self.running.remove(job)
        self.forget_execution(job.id)
        if job.rq_job is not None and requeue(self.connection, job.id, job.lease, job.rq_job):
            log.info(
                "job %s: checkpointed after %d tokens and requeued", job.id, job.completion_tokens
            )
            with self.connection.pipeline() as pipe:
                metrics.count_job(pipe, "requeued")
                pipe.execute()
        self.sync_state()

    def _checkpoint_all(self) -> None:
        if self._has_output():
            self._flush()
        for job in list(self.running.jobs.values()):
            self._checkpoint(job)
