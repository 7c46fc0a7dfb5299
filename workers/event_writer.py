"""The worker's writes for the jobs it runs: every one fenced by the job's lease.

A step's new token events, finished jobs' results, metrics and every running job's cancel
flag go out in one pipeline (`flush`), each job's events through `scripts.append`, which
writes nothing once the lease is another worker's. Failed and cancelled jobs end through
`end`. What the outcome means for a job (dropped, finished, cancelled) is the worker's call:
this module only writes and reports.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from workers import affinity, keys, metrics, scripts
from workers.jobs import ActiveJob
from workers.wire import rate_limit
from workers.wire.defaults import JOB_TTL_SECONDS
from workers.wire.errors import cancelled_error
from workers.wire.events import Event, ending, write_ending
from workers.wire.job import CANCELLED, FINISHED


@dataclass
class Flushed:
    """What one flush found: jobs whose lease is lost (nothing was written for them), jobs
    whose final write landed, and running jobs whose cancel flag is set."""

    lost: list[ActiveJob] = field(default_factory=list)
    finished: list[ActiveJob] = field(default_factory=list)
    cancel_requested: list[ActiveJob] = field(default_factory=list)


@dataclass
class _Write:
    job: ActiveJob
    events: list[tuple[str, str]]
    final: bool


class EventWriter:
    def __init__(self, connection: Any, worker_name: str, own_models: set[str]) -> None:
        self.connection = connection
        self.worker = worker_name
        self.own_models = own_models  # models whose replies record prefix affinity
        self.throughput = metrics.Throughput()

    @staticmethod
    def has_output(jobs: Iterable[ActiveJob]) -> bool:
        return any(j.pending or j.result is not None for j in jobs)

    def flush(self, jobs: Iterable[ActiveJob], step_sizes: dict[str, int] | None) -> Flushed:
        """One round trip: every job's new events (fenced), finished jobs' results, metrics,
        and every running job's cancel flag. `step_sizes` (model -> sequences) after a
        decode step, None otherwise."""
        jobs = list(jobs)
        writes: list[_Write] = []
        tokens: dict[str, int] = {}
        with self.connection.pipeline(transaction=False) as pipe:
            for job in jobs:
                if job.pending or job.result is not None:
                    writes.append(self._append(pipe, job))
                    tokens[job.model] = tokens.get(job.model, 0) + len(job.pending)
            checked = [j for j in jobs if j.result is None]
            for job in checked:
                pipe.exists(keys.job_cancel(job.id))
            self._record_metrics(pipe, writes, tokens, step_sizes)
            self._remember_replies(pipe, writes)
            results = pipe.execute()
        flushed = Flushed()
        for write, written in zip(writes, results, strict=False):
            if written is None:
                flushed.lost.append(write.job)
                continue
            write.job.pending.clear()
            write.job.written += len(write.events)
            if write.final:
                flushed.finished.append(write.job)
        flags = results[len(writes) : len(writes) + len(checked)]
        flushed.cancel_requested = [job for job, flag in zip(checked, flags, strict=True) if flag]
        return flushed

    def end(self, job: ActiveJob, status: str, body: dict[str, Any]) -> bool:
        """Fenced terminal write of a failed or cancelled job; False if it was not ours."""
        end_fields, end_event = ending(status, body)
        events = [*job.pending, end_event]
        fields = {**end_fields, **_counts(job)}
        written = _fenced_append(
            self.connection, job, events, fields, final=True, used=_used_so_far(job)
        )
        if written is None:
            return False
        job.pending.clear()
        job.written += len(events)
        return True

    def cancel_unclaimed(self, job_id: str) -> None:
        """End a job cancelled while it waited. No worker holds it (the claim took no
        lease), so the write needs no fence."""
        with self.connection.pipeline() as pipe:
            write_ending(pipe, job_id, CANCELLED, cancelled_error())
            pipe.execute()
        rate_limit.settle(self.connection, job_id, used=0)  # after, not in, the MULTI

    def count_job(self, state: str) -> None:
        """Count a job in `keys.METRIC_JOBS` where no fenced write does (requeued, or
        failed before it ever ran)."""
        with self.connection.pipeline() as pipe:
            metrics.count_job(pipe, state)
            pipe.execute()

    def tokens_per_second(self) -> float:
        return self.throughput.rate()

    def _append(self, pipe: Any, job: ActiveJob) -> _Write:
        events, final = list(job.pending), job.result is not None
        fields = {"completion_tokens": str(job.completion_tokens)}
        used = None
        if final:
            end_fields, end_event = ending(FINISHED, job.result)
            events.append(end_event)
            fields.update(end_fields)
            fields.update(_counts(job))
            usage = job.result["usage"]
            fields["prompt_tokens"] = str(usage["prompt_tokens"])
            used = usage["prompt_tokens"] + usage.get("completion_tokens", 0)
        _fenced_append(pipe, job, events, fields, final=final, used=used)
        return _Write(job, events, final)

    def _record_metrics(
        self,
        pipe: Any,
        writes: list[_Write],
        tokens: dict[str, int],
        step_sizes: dict[str, int] | None,
    ) -> None:
        if step_sizes is not None:
            metrics.record_step(pipe, step_sizes, tokens)
            self.throughput.add(sum(tokens.values()))
        for write in writes:
            job = write.job
            if write.final and job.result is not None:
                prompt_tokens = job.result["usage"]["prompt_tokens"]
                metrics.count_prompt_tokens(pipe, job.model, prompt_tokens)
                metrics.count_prefix_cache(pipe, job.model, job.prefill_tokens, job.cached_tokens)
            if job.attempt == 1 and job.first_token_at is not None and not job.ttft_recorded:
                metrics.record_ttft(pipe, job.model, max(0.0, time.time() - job.record.created_at))
                job.ttft_recorded = True

    def _remember_replies(self, pipe: Any, writes: list[_Write]) -> None:
        for write in writes:
            job = write.job
            if write.final and job.result is not None and job.model in self.own_models:
                affinity.remember_reply(pipe, self.worker, job.record, job.result)


def _fenced_append(
    client: Any,
    job: ActiveJob,
    events: list[Event],
    fields: dict[str, str],
    *,
    final: bool,
    used: int | None = None,
) -> Any:
    """`scripts.append` of `events` after the ones `job` has written, fenced by its lease:
    the one way this writer puts anything on a job's record or stream (on a pipeline, its
    answer comes from `execute()`). A final write settles the job's rate-limit reservation
    at `used` tokens."""
    return scripts.append(
        client,
        job.id,
        job.lease,
        job.written,
        events,
        fields,
        final=final,
        ttl=JOB_TTL_SECONDS,
        used_tokens=used,
    )


def _counts(job: ActiveJob) -> dict[str, str]:
    """The counters a job's last write puts on its record."""
    return {"completion_tokens": str(job.completion_tokens), "preemptions": str(job.preemptions)}


def _used_so_far(job: ActiveJob) -> int:
    """The tokens a job that fails or is cancelled has used: what it generated, and its
    prompt once a first token shows the prompt was read."""
    if job.plan is None or job.first_token_at is None:
        return job.completion_tokens
    return job.plan.prompt_tokens + job.completion_tokens
