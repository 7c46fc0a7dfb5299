"""The LoRA adapter registry in Redis (`keys.LORAS`): adapter name -> JSON `{"name",
"path", "base_model", "registered_at"}`, `path` relative to `LLMQ_ADAPTER_DIR`.
`POST /admin/loras` writes an entry, `DELETE` removes it; workers load what it names on the
engines of `base_model`. `registered_at` tells one registration from the next: a worker
retries an adapter that failed to load once it is registered again, even at the same path,
and reports which registration its state is about (`workers.loras`)."""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from workers import keys
from workers.wire.text import as_str


def read_registry(conn: redis.Redis) -> dict[str, dict[str, Any]]:
    """Registered adapters by name (malformed entries are skipped)."""
    registry = {}
    for name, raw in conn.hgetall(keys.LORAS).items():
        entry = _entry(raw)
        if entry is not None:
            registry[as_str(name)] = entry
    return registry


def read_entry(conn: redis.Redis, name: str) -> dict[str, Any] | None:
    """One adapter's entry, or None if it is not registered (or malformed)."""
    raw = conn.hget(keys.LORAS, name)
    return None if raw is None else _entry(raw)


def _entry(raw: bytes | str) -> dict[str, Any] | None:
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    if isinstance(entry, dict) and isinstance(entry.get("path"), str):
        return entry
    return None


def register(conn: redis.Redis, name: str, path: str, base_model: str) -> dict[str, Any]:
    entry = {"name": name, "path": path, "base_model": base_model, "registered_at": time.time()}
    conn.hset(keys.LORAS, name, json.dumps(entry))
    return entry


def unregister(conn: redis.Redis, name: str) -> bool:
    return bool(conn.hdel(keys.LORAS, name))


def withdraw(conn: redis.Redis, entry: dict[str, Any], previous: dict[str, Any] | None) -> bool:
    """Undo the registration `entry` if it is still the one in place: `previous` comes back
    (or the name goes). False if someone registered or removed the name meanwhile."""
    key, name = keys.LORAS, entry["name"]
    with conn.pipeline() as pipe:
        try:
            pipe.watch(key)
            if read_entry(pipe, name) != entry:
                return False
            pipe.multi()
            if previous is None:
                pipe.hdel(key, name)
            else:
                pipe.hset(key, name, json.dumps(previous))
            pipe.execute()
            return True
        except redis.WatchError:
            return False
