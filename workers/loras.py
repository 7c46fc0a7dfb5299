"""LoRA adapters on a worker. `POST /admin/loras` records an adapter in `keys.LORAS`
(name -> {name, path, base_model}); every worker loads it on each ready engine of its base
model and unloads what was removed there (`sync`), at each heartbeat and at once when a job
names an adapter its engine lacks. The registry TOML's adapters come with their model and
stay. Each entry's adapter states go out with the pool (`PoolEntry.loras`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from runtime.errors import AdapterError
from runtime.lora import adapter_file
from workers.pool import engine_memory

if TYPE_CHECKING:
    from workers.pool import EnginePool

log = logging.getLogger("llmq.worker")


def sync(pool: EnginePool, registry: dict[str, dict[str, Any]]) -> bool:
    """Make every ready engine hold the registry's adapters for its model; True if any
    adapter was loaded or unloaded."""
    changed = False
    for model in pool.sources:
        entry = pool.get(model)
        if entry is None or entry.engine is None or not hasattr(entry.engine, "adapters"):
            continue
        engine = entry.engine
        fixed = {name for name, _ in engine.spec.loras}
        wanted = {n: e for n, e in registry.items() if e.get("base_model") == model}
        for name in [n for n in engine.adapters if n not in fixed and n not in wanted]:
            engine.unload_adapter(name)
            entry.loras.pop(name, None)
            changed = True
        for name in [n for n in list(entry.loras) if n not in fixed and n not in wanted]:
            del entry.loras[name]  # a failed one that was removed
        for name in fixed:
            entry.loras.setdefault(name, {"state": "ready", "source": "registry"})
        for name, wanted_entry in wanted.items():
            if name not in fixed:
                changed |= _load(engine, entry.loras, name, wanted_entry)
        entry.memory_bytes = engine_memory(engine)
    return changed


def _load(
    engine: Any, states: dict[str, dict[str, Any]], name: str, wanted: dict[str, Any]
) -> bool:
    path, registered_at = wanted["path"], wanted.get("registered_at")
    state = states.get(name) or {}
    if state and state.get("path") == path and state.get("registered_at") == registered_at:
        return False  # loaded, or failed, for this registration: not retried every heartbeat
    try:
        adapter = engine.load_adapter(name, adapter_file(path))
    except (AdapterError, OSError) as exc:
        log.warning("adapter %s (%s) cannot be loaded: %s", name, path, exc)
        states[name] = {
            "state": "failed",
            "path": path,
            "registered_at": registered_at,
            "error": str(exc),
        }
        engine.unload_adapter(name)  # an older version under this name is no longer wanted
        return True
    log.info("adapter %s loaded for %s (%.1f MiB)", name, engine.spec.id, adapter.nbytes / 2**20)
    states[name] = {
        "state": "ready",
        "path": path,
        "registered_at": registered_at,
        "memory_mb": _mb(adapter.nbytes),
    }
    return True


def _mb(n: int) -> float:
    return round(n / 2**20, 2)
