"""The LoRA adapter registry in Redis (`keys.LORAS`): adapter name -> JSON `{"name",
"path", "base_model"}`, `path` inside `LLMQ_ADAPTER_DIR`. `POST /admin/loras` writes an
entry, `DELETE` removes it; workers load what it names on the engines of `base_model`."""

from __future__ import annotations

import json
from typing import Any

import redis

from workers import keys
from workers.wire.text import as_str


def read_registry(conn: redis.Redis) -> dict[str, dict[str, Any]]:
    """Registered adapters by name (malformed entries are skipped)."""
    registry = {}
    for name, raw in conn.hgetall(keys.LORAS).items():
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("path"), str):
            registry[as_str(name)] = entry
    return registry


def register(conn: redis.Redis, name: str, path: str, base_model: str) -> dict[str, Any]:
    entry = {"name": name, "path": path, "base_model": base_model}
    conn.hset(keys.LORAS, name, json.dumps(entry))
    return entry


def unregister(conn: redis.Redis, name: str) -> bool:
    return bool(conn.hdel(keys.LORAS, name))
