"""The jobs a worker is running, and continuous batching across them: which sequences run,
step by step (each model's `Generator` does the batching within one model).

Jobs join between steps (`add`), each model with running sequences gets one batched forward
pass per `step`, and jobs leave when their choices end or when they are removed (cancelled,
failed, lost, checkpointed), which aborts their sequences and frees their KV memory. Jobs
for a model that is still loading wait here until the pool settles the load. No Redis here:
the worker decides what a job's events mean and writes them.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from runtime.engine import Engine
from runtime.errors import LLMQRuntimeError
from runtime.generator import Generator
from runtime.lora import AdapterStack
from workers import keys
from workers.errors import JobFailure
from workers.jobs import ActiveJob
from workers.pool import FAILED, LOADING, EnginePool, PoolEntry
from workers.requests import invalid_request

log = logging.getLogger("llmq.running")


@dataclass
class _ModelGenerator:
    engine: Engine
    generator: Generator


class RunningJobs:
    """A worker's running jobs (`jobs`) and their sequences in one generator per model."""

    def __init__(
        self,
        pool: EnginePool,
        max_sequences: int,
        refresh_adapters: Callable[[], None] | None = None,
    ) -> None:
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be at least 1, got {max_sequences}")
        self.pool = pool
        # called when a job names an adapter its engine lacks, before the job is planned
        # (the worker loads the adapters registered since its last heartbeat)
        self.refresh_adapters = refresh_adapters
        self.max_sequences = max_sequences
        self.jobs: dict[str, ActiveJob] = {}
        self.last_step_sizes: dict[str, int] = {}  # model -> sequences in its last step
        self._generators: dict[str, _ModelGenerator] = {}
        self._waiting: dict[str, list[ActiveJob]] = defaultdict(list)
        self._owners: dict[str, tuple[ActiveJob, int]] = {}  # request id -> (job, choice)

    @property
    def sequences(self) -> int:
        """Sequences in flight; a job still waiting for its model counts as one."""
        waiting = sum(len(jobs) for jobs in self._waiting.values())
        return len(self._owners) + waiting

    def has_room(self) -> bool:
        return self.sequences < self.max_sequences

    def has_work(self) -> bool:
        return bool(self._owners)

    def add(self, job: ActiveJob) -> None:
        """Admit a claimed job. Raises JobFailure (unknown model, failed load, bad request)
        or PoolFull; the job is then not kept."""
        entry = self.pool.request(job.model)
        if entry.state == FAILED:
            assert entry.error is not None
            raise entry.error
        self.jobs[job.id] = job
        if entry.state == LOADING:
            self._waiting[job.model].append(job)
            return
        try:
            self._start(job, entry)
        except Exception:
            self.jobs.pop(job.id, None)
            raise

    def settle_loads(self) -> list[tuple[ActiveJob, JobFailure]]:
        """Start the jobs whose model finished loading; the jobs that fail instead."""
        failures: list[tuple[ActiveJob, JobFailure]] = []
        for entry in self.pool.poll():
            for job in self._waiting.pop(entry.model, []):
                if entry.state == FAILED:
                    assert entry.error is not None
                    failures.append((job, entry.error))
                    continue
                try:
                    self._start(job, entry)
                except JobFailure as exc:
                    failures.append((job, exc))
        return failures

    def step(self) -> tuple[set[ActiveJob], list[tuple[ActiveJob, Exception]]]:
        """One forward pass per model with running sequences. Returns the jobs that got
        tokens, and the jobs to fail: those of a model whose step raised (its generator is
        discarded) and those with a choice the engine ended with an error (`job.failure`)."""
        touched: set[ActiveJob] = set()
        broken: list[tuple[ActiveJob, Exception]] = []
        self.last_step_sizes = {}
        for model, model_run in list(self._generators.items()):
            size = len(model_run.generator)
            if not size:
                entry = self.pool.get(model)
                if entry is None or entry.engine is not model_run.engine:
                    del self._generators[model]  # its model was unloaded: let the memory go
                continue
            try:
                events = model_run.generator.step()
            except Exception as exc:  # one bad step must not take the worker down
                log.exception("step of model %s failed; failing its %d sequences", model, size)
                del self._generators[model]
                jobs = {job for job, _ in self._owners.values() if job.model == model}
                broken.extend((job, exc) for job in jobs)
                continue
            self.last_step_sizes[model] = size
            for event in events:
                job, choice = self._owners[event.request_id]
                failed = job.failure is not None
                if job.on_token(choice, event):  # the engine ended it (stop, length, error)
                    if event.finish_reason is None:  # the job did (a repeated tool call)
                        model_run.generator.abort(event.request_id)
                    self._end_sequence(event.request_id, job)
                if job.failure is not None and not failed:
                    broken.append((job, job.failure))
                touched.add(job)
        return touched, broken

    def remove(self, job: ActiveJob) -> None:
        """Forget a job now: abort its sequences (their KV memory is freed)."""
        self.jobs.pop(job.id, None)
        waiting = self._waiting.get(job.model, [])
        if job in waiting:
            waiting.remove(job)
        model_run = self._generators.get(job.model)
        for request_id in [r for r, (owner, _) in self._owners.items() if owner is job]:
            if model_run is not None:
                model_run.generator.abort(request_id)
            self._end_sequence(request_id, job)

    def _start(self, job: ActiveJob, entry: PoolEntry) -> None:
        self._refresh_adapters_for(job, entry.engine)
        sequences = job.start(entry.engine)
        if not sequences:
            return
        model_run = self._generators.get(job.model)
        if model_run is None or model_run.engine is not entry.engine:
            model_run = self._generators[job.model] = _ModelGenerator(
                entry.engine, entry.engine.new_generator()
            )
        try:  # every choice fits, or none joins: the job fails whole, before any token
            for _, prompt_ids, params in sequences:
                model_run.generator.check_request(prompt_ids, params)
        except LLMQRuntimeError as exc:
            raise invalid_request(exc) from exc
        priority = keys.scheduling_priority(job.record.kind, job.record.priority)
        assert job.plan is not None
        cache_prompt = job.plan.spec.cache_prompt
        adapters = self._adapters(job, entry.engine)
        for request_id, prompt_ids, params in sequences:
            resume = job.resumed.get(request_id, 0)
            model_run.generator.add(
                request_id, prompt_ids, params, priority, cache_prompt, resume, adapters
            )
            choice = int(request_id.rsplit(":", 1)[1])
            self._owners[request_id] = (job, choice)
            self.pool.acquire(job.model)

    def _refresh_adapters_for(self, job: ActiveJob, engine: Engine) -> None:
        """Load the adapters registered since the last heartbeat before the job is planned
        (planning may use them: echo logprobs), when it names one `engine` lacks."""
        record = job.record  # its spec names them; a record without one, its body's `lora`
        listed = record.request.get("lora") if record.spec is None else record.spec.get("adapters")
        listed = listed if isinstance(listed, list) else []
        named = {a.get("name") for a in listed if isinstance(a, dict)}
        if self.refresh_adapters is not None and named - set(getattr(engine, "adapters", {})):
            self.refresh_adapters()

    def _adapters(self, job: ActiveJob, engine: Engine) -> AdapterStack:
        """The job's LoRA stack on `engine`; an adapter it lacks fails the job with 404."""
        assert job.plan is not None
        pairs = job.plan.spec.adapter_pairs()
        if not pairs:
            return ()
        try:
            return engine.adapter_stack(pairs)
        except LLMQRuntimeError as exc:
            raise invalid_request(exc) from exc

    def _end_sequence(self, request_id: str, job: ActiveJob) -> None:
        if self._owners.pop(request_id, None) is not None:
            self.pool.release(job.model)
