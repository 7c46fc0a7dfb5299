"""Named exceptions of the workers. Each one that ends a job knows the OpenAI error body the
job fails with, so the code that catches it never has to guess a status; the body is built
where the API's errors build theirs (`workers.wire.errors.OpenAIError`).
"""

from __future__ import annotations

from typing import Any

from workers.wire.errors import OpenAIError


class WorkerError(Exception):
    """Base of every error the worker raises on purpose."""


class JobFailure(WorkerError, OpenAIError):
    """Ends one job as `failed` with an OpenAI error body; the worker carries on."""

    status = 500
    type = "server_error"

    def body(self) -> dict[str, Any]:
        """What the failed job's `error` event and record carry (with its HTTP status)."""
        return self.job_body()


class InvalidJobRequest(JobFailure):
    """The request cannot be served as asked (context too long, empty prompt, bad values)."""

    status = 400
    type = "invalid_request_error"


class ConstrainedDecodingError(JobFailure):
    """A grammar matcher failed mid-generation (`finish_reason` "error" from the engine).
    Masks only allow tokens the matcher accepts, so this is our fault, never the caller's:
    the job fails with a 500 (which OpenAI clients raise, and retry), rather than finishing
    with output that may not match the schema the caller relies on."""

    code = "constrained_decoding_failed"


class UnknownModelError(JobFailure):
    """The job names a model the registry does not know."""

    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class UnknownAdapterError(JobFailure):
    """A job names a LoRA adapter that is not loaded for its model."""

    status = 404
    type = "invalid_request_error"
    code = "adapter_not_found"


class ModelLoadError(JobFailure):
    """The model is known but could not be loaded (missing file, corrupt GGUF, over budget)."""


class JobRefused(JobFailure):
    """A queue entry that is not an llmq job: another function, other arguments, or data
    that cannot be read as JSON (docs/faults.md F19). It is failed, never executed."""

    code = "job_refused"


class PoolFull(WorkerError):
    """No room for another model: every loaded model has work in flight."""


class PriorityError(WorkerError, ValueError):
    """A worker's nice value out of 0-19 (`--nice`, `LLMQ_WORKER_NICE`; workers/priority.py)."""


class ServeError(WorkerError):
    """`llmq serve` cannot run as asked: its port is taken, or a process it supervises fails
    as soon as it starts, again and again (restarting it for ever would hide why)."""
