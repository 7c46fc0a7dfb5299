"""The warm engines of one worker: an LRU pool bounded by a model count and a memory budget.

The memory budget (`LLMQ_POOL_MEMORY_MB`) holds per device: a GPU's memory and the host's
are separate, so models on cuda:0 never evict, nor count against, models on the cpu.

After mlx-lm's and vLLM's model caches: each model is an entry that is `loading` (in a
background thread, so the decode loop of the other models keeps stepping), `ready` or
`failed`; it counts the sequences in flight on it, and a model with work in flight is never
evicted. A failed load is remembered for `retry_failed_seconds`, so a burst of jobs for a
broken model fails fast with the same error instead of reloading once per job.

`preload` starts loads when the worker starts, so the first request does not wait for one
(and /ready means a model is loaded): only into free slots, and a preloaded model that does
not fit the memory budget is dropped rather than evicting anything.

Only the worker's main thread calls the pool; the loader thread only runs `loader(source)`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime.errors import LLMQRuntimeError, ModelNotFoundError
from workers.errors import JobFailure, ModelLoadError, PoolFull, UnknownModelError
from workers.load_threads import LoadThreads
from workers.wire.worker_info import FAILED, LOADING, READY

if TYPE_CHECKING:
    from runtime.engine import Engine

log = logging.getLogger("llmq.pool")

CAPACITY_ENV, MEMORY_ENV = "LLMQ_POOL_CAPACITY", "LLMQ_POOL_MEMORY_MB"


@dataclass
class PoolConfig:
    """Bounds of the pool; `memory_mb=None` means no memory budget."""

    capacity: int = 2
    memory_mb: float | None = None
    retry_failed_seconds: float = 30.0

    def __post_init__(self) -> None:
        if self.capacity < 1:
            raise ValueError(f"{CAPACITY_ENV} must be at least 1, got {self.capacity}")
        if self.memory_mb is not None and self.memory_mb <= 0:
            raise ValueError(f"{MEMORY_ENV} must be positive, got {self.memory_mb}")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> PoolConfig:
        env = os.environ if environ is None else environ
        memory = env.get(MEMORY_ENV)
        return cls(
            capacity=int(env.get(CAPACITY_ENV) or 2),
            memory_mb=float(memory) if memory else None,
        )


@dataclass
class PoolEntry:
    model: str
    state: str = LOADING
    engine: Engine | None = None  # once ready
    error: JobFailure | None = None
    in_flight: int = 0
    device: str = "cpu"  # where its engine runs, once loaded (the budget it counts against)
    memory_bytes: int = 0  # what its engine holds on `device` (engine_memory)
    load_seconds: float | None = None
    last_used: float = field(default_factory=time.monotonic)
    failed_at: float = 0.0
    loaded_at: float | None = None  # wall-clock time it became ready (published)
    unload_requested: bool = False
    preload: bool = False  # loaded at start-up, before any job asked for it
    future: Future | None = field(default=None, repr=False)
    loras: dict[str, dict[str, Any]] = field(default_factory=dict)  # adapter -> its state

    def describe(self) -> dict[str, Any]:
        """The entry as `WorkerInfo.pool` shows it: `memory_mb` is what the engine holds on its
        `device`: the weights as the backend stores them (int4/fp16/... for torch, float32 for
        numpy), and on a GPU also the KV pool, allocated whole."""
        return {
            "state": self.state,
            "device": self.device,
            "memory_mb": round(self.memory_bytes / 2**20, 1),
            **_backend_state(self.engine),
            "in_flight": self.in_flight,
            "error": str(self.error) if self.error else None,
            "load_seconds": round(self.load_seconds, 3) if self.load_seconds else None,
            "loaded_at": self.loaded_at,
            **_cache_state(self.engine),
            **(
                {"loras": {n: dict(state) for n, state in self.loras.items()}} if self.loras else {}
            ),
        }


def _backend_state(engine: Engine | None) -> dict[str, Any]:
    """Which kernel backend a loaded engine runs on and what each weight got."""
    if engine is None or not hasattr(engine, "backend"):
        return {}
    return {"backend": engine.backend.name, "kernels": engine.model.weight_kinds()}


def _cache_state(engine: Engine | None) -> dict[str, Any]:
    """KV pool use and prefix-cache statistics of a loaded engine (for /admin/models)."""
    if engine is None or not hasattr(engine, "kv_pool"):
        return {}
    pool, cache = engine.kv_pool, engine.prefix_cache
    state: dict[str, Any] = {
        "kv_in_use_mb": round(pool.bytes_in_use / 2**20, 1),
        "kv_pool_mb": round(pool.n_blocks * pool.block_nbytes / 2**20, 1),
    }
    graphs = getattr(engine, "decode_graphs", None)
    if graphs is not None:
        state["decode_graphs"] = {
            "captured": len(graphs.graphs),
            "buckets": len(graphs.buckets),
            "memory_mb": round(graphs.graph_bytes / 2**20, 1),
            "capture_seconds": round(graphs.capture_seconds, 3),
            "lora_graphs": sum(1 for bucket in graphs.graphs if bucket.lora),
        }
        slots = getattr(engine, "lora_slots", None)
        if slots is not None:
            state["decode_graphs"]["lora_slots"] = slots.count
            state["decode_graphs"]["lora_resident"] = len(slots.resident)
            state["decode_graphs"]["lora_slots_mb"] = round(slots.nbytes / 2**20, 1)
    if cache is not None:
        stats = cache.stats
        state["prefix_cache"] = {
            "blocks": len(cache),
            "queries": stats.queries,
            "hits": stats.hits,
            "prompt_tokens": stats.prompt_tokens,
            "cached_tokens": stats.cached_tokens,
            "hit_rate": round(stats.hit_rate, 4),
        }
    return state


def load_engine(
    source: str,
    backend: str | None = None,
    device: str | None = None,
    kv_memory_mb: int | None = None,
    gpu_memory_utilization: float | None = None,
) -> Engine:
    """`backend` None: the model's registry entry decides, else torch where installed;
    `device` None: the registry entry's `device`, else cpu; `kv_memory_mb` None: the
    engine's default KV pool."""
    from runtime.engine import Engine, EngineConfig  # loaded with the first model

    config = EngineConfig(
        backend=backend,
        device=device,
        kv_memory_mb=kv_memory_mb,
        gpu_memory_utilization=gpu_memory_utilization,
    )
    return Engine.load(source, config)


def engine_memory(engine: Any) -> int:
    """The bytes `engine` holds on its device (`Engine.device_bytes`); the weights' `nbytes`
    for an engine that does not say (the tests' fakes)."""
    held = getattr(engine, "device_bytes", None)
    return int(held if held is not None else getattr(engine, "nbytes", 0))


class EnginePool:
    """Engines by model id. `sources` maps a model id to what `loader` takes (a registry id
    or a .gguf path); a model missing from it is unknown (404)."""

    def __init__(
        self,
        config: PoolConfig,
        sources: dict[str, str],
        loader: Callable[[str], Engine] = load_engine,
    ) -> None:
        self.config = config
        self.sources = dict(sources)
        self._loader = loader
        self._entries: dict[str, PoolEntry] = {}
        self._threads = LoadThreads()  # each load in a thread of its own (load_threads.py)

    # ------------------------------------------------------------------ queries

    def get(self, model: str) -> PoolEntry | None:
        return self._entries.get(model)

    @property
    def loading(self) -> bool:
        """Whether a load is in progress (its end must be noticed soon: poll often)."""
        return any(entry.state == LOADING for entry in self._entries.values())

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {model: entry.describe() for model, entry in self._entries.items()}

    def used_bytes(self, device: str) -> int:
        """Bytes held by the ready models on `device` (what its memory budget counts)."""
        return sum(
            e.memory_bytes
            for e in self._entries.values()
            if e.state == READY and e.device == device
        )

    def can_accept(self, model: str) -> bool:
        """Whether a job for `model` can be taken now without waiting for other work to end."""
        entry = self._entries.get(model)
        if entry is not None:
            return True  # loading, ready, or failed (its jobs then fail fast)
        if model not in self.sources:
            return True  # fails with 404 at once
        return len(self._entries) < self.config.capacity or self._evictable() is not None

    # ------------------------------------------------------------------ changes

    def request(self, model: str) -> PoolEntry:
        """The entry for `model`, starting its load (after evicting an idle model) if needed.

        Raises UnknownModelError, or PoolFull when every slot holds a model with work in flight.
        """
        if model not in self.sources:
            known = ", ".join(sorted(self.sources)) or "none"
            raise UnknownModelError(
                f"The model '{model}' does not exist or is not served by this worker "
                f"(it serves: {known}).",
                param="model",
            )
        entry = self._entries.get(model)
        if entry is not None and entry.state == FAILED:
            if time.monotonic() - entry.failed_at < self.config.retry_failed_seconds:
                return entry
            del self._entries[model]
            entry = None
        if entry is None:
            while len(self._entries) >= self.config.capacity:
                victim = self._evictable()
                if victim is None:
                    raise PoolFull(f"no room to load {model}: every model has work in flight")
                self._evict(victim, "to make room for " + model)
            entry = PoolEntry(model)
            entry.future = self._threads.submit(self._load, self.sources[model])
            self._entries[model] = entry
            log.info("loading model %s", model)
        entry.last_used = time.monotonic()
        entry.unload_requested = False
        entry.preload = False  # asked for: an ordinary entry from now on
        return entry

    def preload(self, models: list[str]) -> list[str]:
        """Start loading `models` (in order, one after another in the loader thread) into
        the free slots; returns those started. Never evicts: a worker's start-up must not
        undo a load an admin or a job asked for."""
        started = []
        for model in models:
            if model in self._entries:
                continue
            if len(self._entries) >= self.config.capacity:
                log.info(
                    "not preloading %s: the pool holds %d models (%s); they load on their "
                    "first job",
                    ", ".join(models[models.index(model) :]),
                    self.config.capacity,
                    CAPACITY_ENV,
                )
                break
            self.request(model).preload = True
            started.append(model)
        return started

    def poll(self) -> list[PoolEntry]:
        """Settle loads that finished; returns the entries that became ready or failed."""
        settled = []
        for entry in list(self._entries.values()):
            if entry.state != LOADING or entry.future is None or not entry.future.done():
                continue
            engine, seconds, error = entry.future.result()
            entry.future = None
            if error is None:
                entry.engine, entry.load_seconds = engine, seconds
                entry.device = str(getattr(engine, "device", "cpu"))
                entry.memory_bytes = engine_memory(engine)
                error = self._fit_budget(entry)
            if error is not None and entry.preload:
                # nobody asked for it yet: keep what is loaded; it loads on its first job
                self._evict(entry, f"preloaded, but {error}; it loads on its first job")
                continue
            if error is None:
                entry.state, entry.loaded_at = READY, time.time()
                log.info(
                    "model %s ready on %s in %.2fs (%.0f MiB)",
                    entry.model,
                    entry.device,
                    seconds,
                    entry.memory_bytes / 2**20,
                )
            else:
                entry.state, entry.error, entry.engine = FAILED, error, None
                entry.failed_at = time.monotonic()
                log.error("model %s failed to load: %s", entry.model, error)
            settled.append(entry)
        return settled

    def wait_loaded(self, timeout: float | None = None) -> list[PoolEntry]:
        """Block until every load in progress has finished (for tests and admin loads)."""
        for entry in list(self._entries.values()):
            if entry.future is not None:
                try:
                    entry.future.exception(timeout)
                except TimeoutError:
                    pass
        return self.poll()

    def acquire(self, model: str, sequences: int = 1) -> None:
        entry = self._entries[model]
        entry.in_flight += sequences
        entry.last_used = time.monotonic()

    def release(self, model: str, sequences: int = 1) -> None:
        entry = self._entries.get(model)
        if entry is None:
            return
        entry.in_flight = max(0, entry.in_flight - sequences)
        entry.last_used = time.monotonic()
        if entry.in_flight == 0 and entry.unload_requested:
            self._evict(entry, "unload requested")

    def unload(self, model: str) -> bool:
        """Drop `model` now if idle, else as soon as its last sequence ends. False if absent."""
        entry = self._entries.get(model)
        if entry is None:
            return False
        if entry.in_flight == 0 and entry.state != LOADING:
            self._evict(entry, "unload requested")
        else:
            entry.unload_requested = True
        return True

    def close(self) -> None:
        self._threads.shutdown()

    # ------------------------------------------------------------------ internals

    def _load(self, source: str) -> tuple[Engine | None, float, JobFailure | None]:
        started = time.perf_counter()
        try:
            engine = self._loader(source)
        except ModelNotFoundError as exc:
            return None, 0.0, ModelLoadError(f"model file unavailable: {exc}")
        except LLMQRuntimeError as exc:
            return None, 0.0, ModelLoadError(f"model failed to load: {exc}")
        except Exception as exc:  # a failed load must never take the worker down
            log.exception("unexpected error loading %s", source)
            return None, 0.0, ModelLoadError(f"model failed to load: {type(exc).__name__}: {exc}")
        return engine, time.perf_counter() - started, None

    def _fit_budget(self, entry: PoolEntry) -> JobFailure | None:
        """Evict idle models on the new one's device until it fits that device's memory
        budget, or say why it can't."""
        budget = self.config.memory_mb
        if budget is None:
            return None
        limit, device = budget * 2**20, entry.device
        while (
            not entry.preload
            and entry.memory_bytes <= limit < self.used_bytes(device) + entry.memory_bytes
        ):
            victim = self._evictable(exclude=entry.model, device=device)
            if victim is None:
                break
            self._evict(victim, f"memory budget on {device}")
        free = limit - self.used_bytes(device)
        if entry.memory_bytes <= free:
            return None
        return ModelLoadError(
            f"model {entry.model} needs {entry.memory_bytes / 2**20:.0f} MiB but only "
            f"{free / 2**20:.0f} MiB of the {budget:g} MiB pool budget ({MEMORY_ENV}) on "
            f"{device} is free"
        )

    def _evictable(self, exclude: str | None = None, device: str | None = None) -> PoolEntry | None:
        """The least recently used idle entry (on `device`, if given): the one to drop."""
        idle = [
            e
            for e in self._entries.values()
            if e.in_flight == 0
            and e.state != LOADING
            and e.model != exclude
            and (device is None or e.device == device)
        ]
        return min(idle, key=lambda e: e.last_used) if idle else None

    def _evict(self, entry: PoolEntry, why: str) -> None:
        log.info("unloading model %s (%s)", entry.model, why)
        self._entries.pop(entry.model, None)
        entry.engine = None
