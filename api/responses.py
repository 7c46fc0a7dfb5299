"""Pydantic models of the bodies the API answers with, for the OpenAPI document.

The bodies of generations and errors are `workers.wire.bodies`' models, re-exported here:
workers build every result from them. The others (jobs, files, batches, admin) are built as
plain dicts by their handlers and the wire records; these models describe them as they are,
so that `/openapi.json` documents what a client really gets and schemathesis can check it.
They allow extra fields: a body may carry more than is documented, never less.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

# the generation and error bodies, re-exported for `api.openapi` (`X as X`: on purpose)
from workers.wire.bodies import AssistantMessage as AssistantMessage
from workers.wire.bodies import Body, ErrorDetail
from workers.wire.bodies import ChatChoice as ChatChoice
from workers.wire.bodies import ChatCompletion as ChatCompletion
from workers.wire.bodies import Completion as Completion
from workers.wire.bodies import CompletionChoice as CompletionChoice
from workers.wire.bodies import Embedding as Embedding
from workers.wire.bodies import EmbeddingList as EmbeddingList
from workers.wire.bodies import ErrorBody as ErrorBody
from workers.wire.bodies import Usage as Usage
from workers.wire.job import JOB_STATUSES

# ---------------------------------------------------------------- models


class ModelObject(Body):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    ready: bool = Field(description="a live worker serves it now")
    max_model_len: int | None = Field(default=None, description="its context length")
    chat_template: bool | None = Field(default=None, description="chat requests can be rendered")


class ModelList(Body):
    object: Literal["list"]
    data: list[ModelObject]


# ---------------------------------------------------------------- jobs


JobStatus = Literal[JOB_STATUSES]  # type: ignore[valid-type]


class JobSummary(Body):
    """The 202 answer to an async submission (`Location: /v1/jobs/{id}`)."""

    id: str
    object: Literal["job"]
    status: JobStatus


class JobProgress(Body):
    completion_tokens: int


class Job(Body):
    id: str
    object: Literal["job"]
    endpoint: str
    model: str
    status: JobStatus
    created_at: float
    started_at: float | None
    finished_at: float | None
    attempts: int
    progress: JobProgress
    metadata: dict[str, str] | None = None
    result: dict[str, Any] | None = Field(
        default=None, description="when finished: the body the synchronous call returns"
    )
    error: ErrorDetail | None = Field(default=None, description="when failed or cancelled")


class JobList(Body):
    object: Literal["list"]
    data: list[Job]
    first_id: str | None
    last_id: str | None
    has_more: bool


# ---------------------------------------------------------------- files and batches


class FileObject(Body):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: str
    status: str
    status_details: str | None


class FileList(Body):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(Body):
    id: str
    object: Literal["file"]
    deleted: bool


class RequestCounts(Body):
    total: int
    completed: int
    failed: int


class Batch(Body):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: dict[str, Any] | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(Body):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


# ---------------------------------------------------------------- admin and ops


class AdminList(Body):
    """In-flight jobs, model pools or queues: one object per entry."""

    object: Literal["list"]
    data: list[dict[str, Any]]


class PoolEntryState(Body):
    """One model in a worker's engine pool."""

    state: Literal["loading", "ready", "failed"]
    device: str | None = Field(
        default=None, description="where its engine runs: cpu or cuda:N (once loaded)"
    )
    memory_mb: float | None = Field(
        default=None,
        description="what its engine holds on that device (on a GPU its KV pool too); "
        "LLMQ_POOL_MEMORY_MB bounds each device's sum",
    )
    in_flight: int | None = None
    error: str | None = None


class WorkerObject(Body):
    """A worker as it publishes itself, with whether its heartbeat is still live."""

    name: str
    pid: int
    host: str
    state: str = Field(description="idle | busy | stopping")
    alive: bool
    device: str = Field(
        description="where its models run: cpu, cuda:N, or (no --device) the registry "
        "devices of its models, comma-separated, e.g. cpu,cuda:0"
    )
    max_batch: int = Field(description="sequences it steps together (0: not published)")
    models: list[str]
    queues: list[str]
    current_jobs: list[str]
    pool: dict[str, PoolEntryState] = Field(description="model id -> its pool entry")
    started_at: float
    heartbeat: float


class WorkerList(Body):
    object: Literal["list"]
    data: list[WorkerObject]


class ModelCommand(Body):
    """A load/unload command, as sent to each live worker named."""

    model: str = Field(description="a model id from the registry (never a path or URL)")


class LoraRegistration(Body):
    """`POST /admin/loras`: an adapter file inside LLMQ_ADAPTER_DIR for a served model."""

    name: str = Field(description="the id requests use (`lora[].name`, or `model`)")
    path: str = Field(description="relative to LLMQ_ADAPTER_DIR; never a URL")
    base_model: str


class Lora(Body):
    object: Literal["lora"]
    name: str
    base_model: str
    workers: dict[str, Any] | None = Field(
        default=None, description="its state on each live worker serving the base model"
    )


class LoraList(Body):
    object: Literal["list"]
    data: list[Lora]


class LoraDeleted(Body):
    object: Literal["lora"]
    name: str
    deleted: bool


class ModelCommandSent(Body):
    op: str
    model: str
    workers: list[str]


class Health(Body):
    status: Literal["ok"]


class Ready(Body):
    status: Literal["ready"]
    workers: int
    models: list[str]
