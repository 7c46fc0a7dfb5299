"""The worker's writes for the jobs it runs: every one fenced by the job's lease.

A step's writes are one script call for every job (`scripts.write_step`, by EVALSHA): each
job's new token events (nothing lands once its lease is another worker's), a finished job's
result and end, and every running job's cancel flag; the metrics ride in the same pipeline.
So Redis runs one command a step, not one per job (bench/redis_cost.py measures it).

`send(..., background=True)` hands the step to one writer thread (its own pooled
connection), so its round trip runs beside the next decode step instead of between steps;
`collect` waits for it and says what it found, for the loop to act on before the step
after (a lost lease, a finished job or a cancel is acted on at most one step late, never
lost). Only one step is in flight: the next is built after the last one's outcome is
applied, so each write is fenced on the stream length the last one left. A step whose round
trip failed (Redis down) is kept and sent again first, exactly as it was, so the script's
retry check finds it if it had landed. Failed and cancelled jobs end through `end`, after
the step in flight. What the outcome means for a job (dropped, finished, cancelled) is the
worker's call: this module only writes and reports. Where the streams are (the queue Redis,
or an events cluster, where a step is two round trips) is the `workers.event_store` object's
the worker hands it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from workers import affinity, metrics, scripts
from workers.event_store import Events
from workers.jobs import ActiveJob
from workers.wire import rate_limit
from workers.wire.errors import cancelled_error
from workers.wire.events import Event, ending
from workers.wire.job import CANCELLED, FINISHED

# A running job's record counters (`completion_tokens`, which /admin shows) are rewritten at
# most this often: an HSET per job per step was ~1 us of Redis a token (bench/redis_cost.py),
# and the API's progress reads the stream's length too (api/jobs.py). Its end writes them.
COUNTERS_SECONDS = 1.0


@dataclass
class Flushed:
    """What writes found: jobs whose lease is lost (nothing was written for them), jobs
    whose final write landed, and running jobs whose cancel flag is set."""

    lost: list[ActiveJob] = field(default_factory=list)
    finished: list[ActiveJob] = field(default_factory=list)
    cancel_requested: list[ActiveJob] = field(default_factory=list)


@dataclass
class _Write:
    job: ActiveJob
    taken: list[Event]  # from the job's `pending`: given back if the lease is lost
    events: list[Event]  # `taken`, and the terminal event of a final write
    final: bool


@dataclass
class _Step:
    """One step's writes: per job (in the call's order) its write, if any; the call as the
    event store sends it (`Events.pack`); and the metrics commands that go with it (sent
    once: not again after a failed round trip)."""

    jobs: list[ActiveJob]
    writes: list[_Write | None]
    packed: Any
    metrics: list[tuple[Any, ...]]


class EventWriter:
    def __init__(
        self,
        connection: Any,
        worker_name: str,
        own_models: set[str],
        events: Events,
    ) -> None:
        self.connection = connection  # the records and metrics
        self.events = events  # where the streams and leases are
        self.worker = worker_name
        self.own_models = own_models  # models whose replies record prefix affinity
        self.throughput = metrics.Throughput()
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight: tuple[_Step, Future[Any]] | None = None
        self._unsent: _Step | None = None  # its round trip failed: sent again first
        self._outcome = Flushed()

    def has_output(self, jobs: Iterable[ActiveJob]) -> bool:
        """Anything to write: a job's new events, a result whose write is not sent yet, or a
        step whose round trip failed."""
        if self._unsent is not None:
            return True
        return any(j.pending or (j.result is not None and not j.ending_sent) for j in jobs)

    def flush(self, jobs: Iterable[ActiveJob], step_sizes: dict[str, int] | None) -> Flushed:
        """One round trip, waited for: every job's new events (fenced), finished jobs'
        results, metrics, and every running job's cancel flag. `step_sizes` (model ->
        sequences) after a decode step, None otherwise. Includes what a step in flight
        found."""
        self.send(jobs, step_sizes)
        return self.collect()

    def send(
        self,
        jobs: Iterable[ActiveJob],
        step_sizes: dict[str, int] | None,
        background: bool = False,
    ) -> None:
        """`flush`'s writes; with `background`, in the writer thread, whose outcome the
        next `collect` (or `send`, `end`) waits for."""
        self._settle()
        self._send_unsent()
        step = self._build(list(jobs), step_sizes)
        if step is None:
            return
        if not background:
            self._apply(step, self._execute(step))
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"llmq-writer-{self.worker}")
        self._in_flight = (step, self._executor.submit(self._execute, step))

    def collect(self) -> Flushed:
        """What the writes since the last `collect` found (waits for the step in flight);
        raises what its round trip raised (the step is then sent again first)."""
        self._settle()
        outcome, self._outcome = self._outcome, Flushed()
        return outcome

    def close(self) -> None:
        """Wait for the step in flight and stop the writer thread."""
        try:
            self._settle()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def end(self, job: ActiveJob, status: str, body: dict[str, Any]) -> bool:
        """Fenced terminal write of a failed or cancelled job; False if it was not ours."""
        self._settle()  # fenced on the length the step in flight leaves
        self._send_unsent()
        end_fields, end_event = ending(status, body)
        events = [*job.pending, end_event]
        fields = {**end_fields, **_counts(job)}
        if not self.events.end(job, events, fields, _used_so_far(job)):
            return False
        job.pending.clear()
        job.written += len(events)
        return True

    def cancel_unclaimed(self, job_id: str) -> None:
        """End a job cancelled while it waited. No worker holds it (the claim took no
        lease), so the write needs no fence."""
        self.events.end_unclaimed(job_id, CANCELLED, cancelled_error())
        rate_limit.settle(self.connection, job_id, used=0)  # after, not in, the MULTI

    def count_job(self, state: str) -> None:
        """Count a job in `keys.METRIC_JOBS` where no fenced write does (requeued, or
        failed before it ever ran)."""
        with self.connection.pipeline() as pipe:
            metrics.count_job(pipe, state)
            pipe.execute()

    def tokens_per_second(self) -> float:
        return self.throughput.rate()

    # ------------------------------------------------------------------ one step

    def _build(self, jobs: list[ActiveJob], step_sizes: dict[str, int] | None) -> _Step | None:
        now = time.monotonic()
        step = _Step([], [], None, [])
        tokens: dict[str, int] = {}
        entries = []
        for job in jobs:
            write = None
            if job.pending or (job.result is not None and not job.ending_sent):
                write, entry = self._entry(job, now)
                tokens[job.model] = tokens.get(job.model, 0) + len(write.taken)
            elif job.result is None:
                entry = scripts.step_entry(job.id, job.lease, scripts.STEP_CHECK_ONLY)
            else:
                continue  # its final write is sent: nothing more to write or read
            step.jobs.append(job)
            step.writes.append(write)
            entries.append(entry)
        if not entries:
            return None
        step.packed = self.events.pack(entries)
        writes = [w for w in step.writes if w is not None]
        recorder = self.connection.pipeline(transaction=False)  # only records: never sent
        self._record_metrics(recorder, writes, tokens, step_sizes)
        self._remember_replies(recorder, writes)
        step.metrics = [tuple(args) for args, _ in recorder.command_stack]
        recorder.reset()
        return step

    def _entry(self, job: ActiveJob, now: float) -> tuple[_Write, tuple[list[str], list[Any]]]:
        taken, job.pending = job.pending, []
        events = list(taken)
        fields: dict[str, str] = {}
        used = None
        final = job.result is not None
        if final:
            assert job.result is not None
            end_fields, end_event = ending(FINISHED, job.result)
            events.append(end_event)
            fields.update(end_fields)
            fields.update(_counts(job))
            usage = job.result["usage"]
            fields["prompt_tokens"] = str(usage["prompt_tokens"])
            used = usage["prompt_tokens"] + usage.get("completion_tokens", 0)
            mode = scripts.STEP_FINAL
            job.ending_sent = True
        else:
            mode = scripts.STEP_WRITE if job.ttl_set else scripts.STEP_FIRST_WRITE
            job.ttl_set = True
            if job.counters_at is None or now - job.counters_at >= COUNTERS_SECONDS:
                fields["completion_tokens"] = str(job.completion_tokens)
                job.counters_at = now
        entry = scripts.step_entry(
            job.id, job.lease, mode, job.written, events, fields, used, check_cancel=not final
        )
        return _Write(job, taken, events, final), entry

    def _execute(self, step: _Step) -> Any:
        """The step's round trip (in the writer thread when sent in the background): its
        writes and the metrics (`Events.write_step`); `scripts.write_step`'s reply. A step
        sent again after a failed round trip carries its writes alone, as they were."""
        metrics, step.metrics = step.metrics, []
        return self.events.write_step(step.packed, metrics)

    def _settle(self) -> None:
        """Apply the outcome of the step in flight, once it is back."""
        if self._in_flight is None:
            return
        step, future = self._in_flight
        self._in_flight = None
        try:
            reply = future.result()
        except Exception:
            self._unsent = step
            raise
        self._apply(step, reply)

    def _send_unsent(self) -> None:
        if self._unsent is None:
            return
        step = self._unsent
        reply = self._execute(step)
        self._unsent = None
        self._apply(step, reply)

    def _apply(self, step: _Step, reply: Any) -> None:
        outcome = self._outcome
        results = scripts.step_results(reply)
        for job, write, (written, cancel) in zip(step.jobs, step.writes, results, strict=True):
            if write is not None and written:
                job.written += len(write.events)
                if write.final:
                    outcome.finished.append(job)
            elif write is not None:
                job.pending[:0] = write.taken  # not written: a later end may still need them
                job.ending_sent = False
                outcome.lost.append(job)
            if cancel and job not in outcome.cancel_requested:  # once until collected
                outcome.cancel_requested.append(job)

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


def _counts(job: ActiveJob) -> dict[str, str]:
    """The counters a job's last write puts on its record."""
    return {"completion_tokens": str(job.completion_tokens), "preemptions": str(job.preemptions)}


def _used_so_far(job: ActiveJob) -> int:
    """The tokens a job that fails or is cancelled has used: what it generated, and its
    prompt once a first token shows the prompt was read."""
    if job.plan is None or job.first_token_at is None:
        return job.completion_tokens
    return job.plan.prompt_tokens + job.completion_tokens
