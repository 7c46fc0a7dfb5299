"""What one `llmq worker` serves and how it behaves, resolved once at start-up.

`serving()` turns `--models` and `--queues` into the model sources the pool loads from and
the RQ queues to take jobs from, interactive queues first: a worker serves a model's
interactive queue before any batch queue.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from runtime.devices import CPU, DeviceError, check_device, is_cuda
from runtime.kernels import BACKEND_ENV, BACKENDS
from runtime.registry import DEFAULT_MODEL, load_registry
from workers import keys
from workers.errors import WorkerError
from workers.pool import PoolConfig
from workers.wire.broker import BrokerConfigError, BrokerSettings, EventsSettings
from workers.wire.defaults import LEASE_RENEW_SECONDS, LEASE_TTL_SECONDS

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
STEP_DELAY_ENV = "LLMQ_WORKER_STEP_DELAY_MS"
DEVICE_ENV = "LLMQ_DEVICE"
# The idle wait is one BLPOP, which must end before the worker's Redis socket timeout (5 s)
# and leave its heartbeat (every 5 s, TTL 15 s) on time.
MAX_POLL_INTERVAL = 4.0
# sequences stepped together, across models: a CPU decode step's weight products cost about
# the same for 1 and 32 rows, so 32 gives ~5x one stream's tokens/s (bench/RESULTS.md
# "Engine vs llama.cpp"); a GPU's step costs about the same for 1 and 256 rows
MAX_SEQUENCES_CPU, MAX_SEQUENCES_GPU = 32, 256


class ConfigError(WorkerError):
    """A worker configuration that cannot work (unknown model, foreign queue name)."""


@dataclass
class WorkerConfig:
    redis_url: str = DEFAULT_REDIS_URL
    name: str | None = None  # default "{host}.{pid}", unique per process
    models: list[str] = field(default_factory=list)  # registry ids or .gguf paths; [] = all
    queues: list[str] = field(default_factory=list)  # llmq queue names or kinds; [] = all
    # "cpu" or "cuda[:N]" for every model it serves; None: each model's registry entry, else cpu
    device: str | None = None
    backend: str | None = None  # kernel backend; None: each model's registry entry, else torch
    # sequences stepped together (--max-batch); None: MAX_SEQUENCES_GPU on CUDA, else _CPU
    max_sequences: int | None = None
    # each engine's paged KV pool (--kv-memory-mb); None: the engine's default
    # (`runtime.engine.EngineConfig.kv_memory_mb`)
    kv_memory_mb: int | None = None
    # on a GPU, the KV pool's share of the memory free after the weights
    # (--gpu-memory-utilization); None: the engine's default (runtime/placement.py)
    gpu_memory_utilization: float | None = None
    grace: float = 25.0  # seconds a SIGTERM lets running jobs finish before checkpointing
    poll_interval: float = 0.05  # idle wait between looks at the queues (a queued job's
    # wake token ends it at once: the poll is the fallback for jobs queued without one)
    lease_ttl: float = LEASE_TTL_SECONDS
    lease_renew: float = LEASE_RENEW_SECONDS
    reap_interval: float = 2.0
    step_delay: float = 0.0  # fault-injection tests slow the decode loop down with this
    install_signals: bool = True  # False when the worker runs in a thread (tests)
    preload: bool = True  # load `preload_models` at start-up, not when a first job asks
    pool: PoolConfig = field(default_factory=PoolConfig)
    # where Redis is when found through Sentinel (`from_env`); None: the one at `redis_url`
    sentinel: BrokerSettings | None = None
    # where the jobs' event streams and leases live (`LLMQ_EVENTS_CLUSTER`); default: above
    events: EventsSettings = field(default_factory=EventsSettings)

    @property
    def broker(self) -> BrokerSettings:
        return self.sentinel or BrokerSettings(url=self.redis_url)

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in BACKENDS:
            raise ConfigError(
                f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"
            )
        if self.device is not None:
            self.device = _checked_device(self.device)
        if self.max_sequences is None:
            self.max_sequences = default_max_sequences(self.device)
        if self.max_sequences < 1:
            raise ConfigError(f"--max-batch must be at least 1, got {self.max_sequences}")
        share = self.gpu_memory_utilization
        if share is not None and not 0.0 < share <= 0.95:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 0.95], got {share}")
        if self.kv_memory_mb is not None and self.kv_memory_mb < 1:
            raise ConfigError(f"--kv-memory-mb must be at least 1, got {self.kv_memory_mb}")
        if self.grace < 0:
            raise ConfigError(f"--grace must be non-negative, got {self.grace}")
        if not 0 < self.poll_interval <= MAX_POLL_INTERVAL:
            raise ConfigError(
                f"--poll-interval must be in (0, {MAX_POLL_INTERVAL:g}], got {self.poll_interval}"
            )
        if self.lease_renew >= self.lease_ttl:
            raise ConfigError("leases must be renewed more often than they expire")

    @property
    def worker_name(self) -> str:
        return self.name or f"{socket.gethostname()}.{os.getpid()}"

    @classmethod
    def from_env(cls, **overrides: object) -> WorkerConfig:
        delay = os.environ.get(STEP_DELAY_ENV)
        try:  # REDIS_URL (or --redis-url) and REDIS_SENTINELS both set is an error
            broker = BrokerSettings.from_env(url=overrides.get("redis_url"))  # type: ignore[arg-type]
            events = EventsSettings.from_env()
        except BrokerConfigError as exc:
            raise ConfigError(str(exc)) from None
        base = {
            "redis_url": broker.url or DEFAULT_REDIS_URL,
            "sentinel": broker if broker.uses_sentinel else None,
            "events": events,
            "backend": os.environ.get(BACKEND_ENV) or None,
            "device": os.environ.get(DEVICE_ENV) or None,
            "pool": PoolConfig.from_env(),
            "step_delay": float(delay) / 1000 if delay else 0.0,
        }
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)  # type: ignore[arg-type]


def _checked_device(device: str) -> str:
    """`device` normalised ("cuda" -> "cuda:0") once this machine is known to run it: no
    silent CPU run for a GPU request, and the reason in one line."""
    try:
        return check_device(device)
    except DeviceError as exc:
        raise ConfigError(str(exc)) from None


def default_max_sequences(device: str | None) -> int:
    """The sequences a worker steps together by default: a GPU's decode step costs about the
    same for far more sequences than a CPU's. `device` None (each model's registry entry
    decides) counts as cpu."""
    return MAX_SEQUENCES_GPU if device is not None and is_cuda(device) else MAX_SEQUENCES_CPU


def worker_device(config: WorkerConfig, sources: dict[str, str]) -> str:
    """The device a worker advertises: its --device, else the devices its models' registry
    entries name (cpu where none does), comma-separated, e.g. "cpu" or "cpu,cuda:0"."""
    if config.device is not None:
        return config.device
    registry = load_registry()
    named = {(registry[s].device or CPU) if s in registry else CPU for s in sources.values()}
    return ",".join(sorted(named)) or CPU


def serving(config: WorkerConfig) -> tuple[dict[str, str], list[str]]:
    """(model id -> what the engine loads, queue names in service order)."""
    registry = load_registry()
    sources: dict[str, str] = {}
    for model in config.models:
        path = Path(model).expanduser()
        if model in registry:
            sources[model] = model
        elif path.suffix == ".gguf" or path.is_file():
            sources[path.stem] = str(path)
        else:
            known = ", ".join(sorted(registry))
            raise ConfigError(f"unknown model {model!r}; known models: {known} (or a .gguf path)")
    kinds = [k for k in keys.QUEUE_KINDS if k in config.queues] or list(keys.QUEUE_KINDS)
    named = [q for q in config.queues if q not in keys.QUEUE_KINDS]
    pairs: list[tuple[str, str]] = []
    for name in named:
        try:
            model, kind = keys.parse_queue_name(name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if model not in sources:
            if model not in registry:
                raise ConfigError(f"queue {name} is for model {model!r}, which is not known")
            sources[model] = model
        pairs.append((model, kind))
    if not config.models and not named:
        sources = {model: model for model in registry}
    if not named:
        pairs = [(model, kind) for model in sources for kind in kinds]
    order = {kind: i for i, kind in enumerate(keys.QUEUE_KINDS)}
    pairs.sort(key=lambda pair: order[pair[1]])  # stable: model order kept within a kind
    return sources, [keys.queue_name(model, kind) for model, kind in pairs]


def preload_models(config: WorkerConfig, sources: dict[str, str]) -> list[str]:
    """The models a worker loads as it starts: every one named by --models (as far as the
    pool has room), else the default model (or the first one served). A worker that serves
    the whole registry by default must not load all of it, only what a first request most
    likely asks for."""
    if not config.preload:
        return []
    if config.models:
        return list(sources)
    return [DEFAULT_MODEL] if DEFAULT_MODEL in sources else list(sources)[:1]
