"""Pydantic models of the bodies the API answers with, for the OpenAPI document.

The bodies of generations, errors, files and batches are `workers.wire.bodies`' models,
re-exported here: workers and the wire records build them. The others (jobs, admin, ops) are
built from these models by their handlers, so that `/openapi.json` documents what a client
really gets and schemathesis can check it. They allow extra fields: a body may carry more
than is documented, never less.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

# the generation and error bodies, re-exported for `api.openapi` (`X as X`: on purpose)
from workers.wire.bodies import AssistantMessage as AssistantMessage
from workers.wire.bodies import Batch as Batch
from workers.wire.bodies import BatchUsage as BatchUsage
from workers.wire.bodies import Body, ErrorDetail
from workers.wire.bodies import ChatChoice as ChatChoice
from workers.wire.bodies import ChatCompletion as ChatCompletion
from workers.wire.bodies import Completion as Completion
from workers.wire.bodies import CompletionChoice as CompletionChoice
from workers.wire.bodies import Embedding as Embedding
from workers.wire.bodies import EmbeddingList as EmbeddingList
from workers.wire.bodies import ErrorBody as ErrorBody
from workers.wire.bodies import FileObject as FileObject
from workers.wire.bodies import RequestCounts as RequestCounts
from workers.wire.bodies import Usage as Usage
from workers.wire.job import JOB_STATUSES

# the Responses API's objects, rendered by `workers.wire.responses_api`
from workers.wire.responses_api import ResponseDeleted as ResponseDeleted
from workers.wire.responses_api import ResponseItemList as ResponseItemList
from workers.wire.responses_api import ResponseObject as ResponseObject

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
    priority: int = Field(description="lower is served sooner; batch lines after all others")
    created_at: float
    started_at: float | None
    finished_at: float | None
    attempts: int
    preemptions: int = Field(
        description="times its last run gave its KV memory to higher-priority work"
    )
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


class BatchList(Body):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


# ---------------------------------------------------------------- admin and ops
# Field order is the body's key order: a model's `dump` writes its fields in declaration
# order, so each follows what its source writes (`workers/pool.py` `describe`,
# `workers/wire/worker_info.py` `WorkerInfo`, `workers/loras.py`).


class RunningJob(Body):
    """A job a live worker runs now; never its prompt."""

    id: str
    model: str
    kind: str = Field(description="interactive | batch: the queue it came from")
    priority: int = Field(description="lower is served sooner, within its kind")
    status: JobStatus
    worker: str
    completion_tokens: int = Field(description="tokens streamed so far")
    created_at: float
    started_at: float | None


class RunningJobList(Body):
    object: Literal["list"]
    data: list[RunningJob] = Field(description="oldest first")


class LoraOnWorker(Body):
    """An adapter on one worker's engine of its base model."""

    state: str = Field(description="pending | ready | failed")
    path: str | None = None
    registered_at: float | None = Field(
        default=None, description="the registration this state is about"
    )
    memory_mb: float | None = None
    error: str | None = Field(default=None, description="why it failed to load")
    source: str | None = Field(default=None, description="registry: named by a registry TOML")


class DecodeGraphStats(Body):
    """The static decode buckets of an engine on the tensor path (runtime/decode_graphs.py)."""

    captured: int = Field(description="buckets captured as CUDA graphs (0 on the CPU)")
    buckets: int = Field(description="batch-size x table-width buckets")
    memory_mb: float = Field(description="device memory of the graphs' shared pool")
    capture_seconds: float
    lora_graphs: int = Field(
        default=0, description="of the captured graphs, those of steps with LoRA rows"
    )
    lora_slots: int = Field(
        default=0, description="adapter slots the graphs read (runtime/lora_slots.py)"
    )
    lora_resident: int = Field(default=0, description="adapters in those slots now")
    lora_slots_mb: float = Field(default=0.0, description="device memory of the slots")


class PrefixCacheStats(Body):
    blocks: int
    queries: int
    hits: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float


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
    backend: str | None = Field(default=None, description="its kernel backend (once loaded)")
    kernels: dict[str, int] | None = Field(
        default=None, description="how many weights each kernel got, e.g. {int4: 120}"
    )
    in_flight: int | None = None
    error: str | None = None
    load_seconds: float | None = None
    loaded_at: float | None = None
    kv_in_use_mb: float | None = None
    kv_pool_mb: float | None = Field(
        default=None, description="its KV pool's size (on a GPU allocated whole at load)"
    )
    decode_graphs: DecodeGraphStats | None = Field(
        default=None, description="its decode steps' static buckets and captured CUDA graphs"
    )
    prefix_cache: PrefixCacheStats | None = None
    loras: dict[str, LoraOnWorker] | None = Field(default=None, description="adapter -> state")


class LoopStats(Body):
    """Where a worker's loop spent its last few seconds (workers/loop_clock.py): ms per
    decode step in each part of its tick. Through the API a step costs `step_ms` plus the
    rest; in-process only `step_ms`."""

    seconds: float = Field(description="the window these figures cover")
    steps: int = Field(description="decode steps in it")
    chores_ms: float = Field(description="leases, heartbeat, presence, reaper, batches")
    claim_ms: float = Field(description="taking jobs off the queues")
    step_ms: float = Field(description="the engines' forward passes and sampling")
    writes_ms: float = Field(description="waiting for and acting on the token writes")
    ends_ms: float = Field(description="failing the jobs a step broke")
    idle_ms: float = Field(description="waiting for work")
    busy: float = Field(description="share of the window not idle")


class WorkerObject(Body):
    """A worker as it publishes itself, with whether its heartbeat is still live."""

    name: str
    pid: int
    host: str
    state: str = Field(description="idle | busy | stopping")
    models: list[str]
    queues: list[str]
    current_jobs: list[str]
    pool: dict[str, PoolEntryState] = Field(description="model id -> its pool entry")
    started_at: float
    heartbeat: float
    max_sequences: int = Field(description="sequences it steps together (0: not published)")
    device: str = Field(
        description="where its models run: cpu, cuda:N, or (no --device) the registry "
        "devices of its models, comma-separated, e.g. cpu,cuda:0"
    )
    loop: LoopStats | None = Field(
        default=None, description="where its loop's time went (absent: an older worker)"
    )
    alive: bool


class WorkerList(Body):
    object: Literal["list"]
    data: list[WorkerObject]
    broker: BrokerState


class ModelPool(Body):
    """A model: what workers published of it, and its pool entry on each live worker."""

    id: str
    info: dict[str, Any] = Field(
        description="as published: source, owned_by, chat_template, context_length"
    )
    serving: list[str] = Field(description="live workers that serve it")
    pools: dict[str, PoolEntryState] = Field(description="worker name -> its pool entry")


class ModelPoolList(Body):
    object: Literal["list"]
    data: list[ModelPool]


class QueueObject(Body):
    """An RQ queue: jobs waiting on it, and the job count of each of its RQ registries. A
    priority level's list (`llmq-{model}-{kind}:p{priority}`) is listed as a queue of its
    own; its jobs' registries are its shared queue's."""

    name: str
    priority: int = Field(description="the priority of the jobs waiting on it")
    queued: int
    started: int
    finished: int
    failed: int
    deferred: int
    scheduled: int
    canceled: int


class QueueList(Body):
    object: Literal["list"]
    data: list[QueueObject]


class HistoryPoint(Body):
    """One moment of the dashboard's charts (`api.history`)."""

    time: float = Field(description="Unix time of the sample")
    tokens_per_second: float | None = Field(
        description="tokens generated per second since the sample before (all models)"
    )
    queue_depth: int = Field(description="jobs waiting on every queue")
    running_jobs: int = Field(description="jobs being generated")
    ttft_p50_seconds: float | None = Field(
        description="median time to first token over the minute before (none: no first token)"
    )
    ttft_p95_seconds: float | None = Field(description="its 95th percentile")


class History(Body):
    object: Literal["list"]
    interval_seconds: int = Field(description="how often the workers take a sample")
    data: list[HistoryPoint] = Field(description="the last 15 minutes, oldest first")


class ModelCommand(Body):
    """A load/unload command, as sent to each live worker named."""

    model: str = Field(description="a model id from the registry (never a path or URL)")


class ModelCommandSent(Body):
    op: Literal["load", "unload"]
    model: str
    workers: list[str] = Field(description="the live workers the command was sent to")


class LoraRegistration(Body):
    """`POST /admin/loras`: an adapter file inside LLMQ_ADAPTER_DIR for a served model."""

    name: str = Field(description="the id requests use (`lora[].name`, or `model`)")
    path: str = Field(
        description="inside LLMQ_ADAPTER_DIR: relative to it or absolute (symlinks are "
        "followed and must stay inside); never a URL"
    )
    base_model: str


class Lora(Body):
    name: str
    path: str | None = Field(
        default=None,
        description="when registered through the API: relative to LLMQ_ADAPTER_DIR",
    )
    base_model: str
    source: str | None = Field(default=None, description="registry: named by a registry TOML")
    registered_at: float | None = Field(default=None, description="when registered (Unix time)")
    object: Literal["lora"]
    state: Literal["ready", "pending", "failed"] | None = Field(
        default=None,
        description="ready: a live worker has it loaded, requests may name it; pending: "
        "none has yet (none holds the base model loaded, or it is still loading), a worker "
        "loads it before running a request that names it; failed: every live worker "
        "holding the base model failed to load it (GET only: POST refuses it with a 400)",
    )
    workers: dict[str, LoraOnWorker] | None = Field(
        default=None, description="its state on each live worker holding the base model"
    )


class LoraList(Body):
    object: Literal["list"]
    data: list[Lora]


class LoraDeleted(Body):
    name: str
    object: Literal["lora"]
    deleted: bool


class Health(Body):
    status: Literal["ok"]


class BrokerState(Body):
    """The Redis this API process writes to (`INFO replication`), so that a failover shows."""

    master: str = Field(description="host:port of the master in use")
    role: str = Field(description="master (or unknown for a server without INFO)")
    replicas: int = Field(description="replicas connected to it")
    sentinel: bool = Field(description="whether the master is found through Redis Sentinel")


class Ready(Body):
    status: Literal["ready"]
    workers: int
    models: list[str]
    broker: BrokerState
