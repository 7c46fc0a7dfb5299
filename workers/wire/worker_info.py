"""A worker as it publishes itself in `keys.worker(name)` (and its name in `keys.WORKERS`).

`keys.MODELS` values, written alongside on every heartbeat: JSON `{"id", "source",
"owned_by": "llmq"}`, plus `"chat_template"` (bool: whether chat requests can be rendered)
once a worker has read the model's GGUF header, and `"context_length"` once it has loaded
the model (the registry's models plus any .gguf path a worker serves, under the file's stem).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from workers.wire.defaults import WORKER_TTL_SECONDS
from workers.wire.text import text_hash

LOADING, READY, FAILED = "loading", "ready", "failed"  # states of a `WorkerInfo.pool` entry


@dataclass
class WorkerInfo:
    """`pool` maps model id -> {"state": "loading" | "ready" | "failed", "device": str,
    "memory_mb": float, "in_flight": int, "error": str | None}; `models` are the models it
    serves (ready or loadable), `queues` the RQ queues it takes jobs from, `current_jobs` the
    job ids it runs; `device` where its models run ("cpu", "cuda:0", or the registry's
    devices of its models comma-separated, e.g. "cpu,cuda:0"; "cpu" in records of workers
    that predate it).
    """

    name: str
    pid: int = 0
    host: str = ""
    state: str = "idle"  # idle | busy | stopping
    models: list[str] = field(default_factory=list)
    queues: list[str] = field(default_factory=list)
    current_jobs: list[str] = field(default_factory=list)
    pool: dict[str, Any] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    heartbeat: float = field(default_factory=time.time)
    max_sequences: int = 0  # sequences it steps together (0: not published)
    device: str = "cpu"
    # where its loop's time went over the last few seconds: ms per decode step in each
    # phase (workers/loop_clock.py); empty in records of workers that predate it
    loop: dict[str, float] = field(default_factory=dict)

    def to_hash(self) -> dict[str, str]:
        return {
            name: json.dumps(value) if isinstance(value, list | dict) else str(value)
            for name, value in asdict(self).items()
        }

    @classmethod
    def from_hash(cls, raw: dict[bytes | str, bytes | str]) -> WorkerInfo:
        h = text_hash(raw)
        return cls(
            name=h["name"],
            pid=int(h.get("pid", 0)),
            host=h.get("host", ""),
            state=h.get("state", "idle"),
            models=json.loads(h.get("models", "[]")),
            queues=json.loads(h.get("queues", "[]")),
            current_jobs=json.loads(h.get("current_jobs", "[]")),
            pool=json.loads(h.get("pool", "{}")),
            started_at=float(h.get("started_at", 0)),
            heartbeat=float(h.get("heartbeat", 0)),
            # "max_batch": the same field as workers before the rename published it
            max_sequences=int(h.get("max_sequences", h.get("max_batch", 0))),
            device=h.get("device") or "cpu",
            loop=json.loads(h.get("loop", "{}")),
        )

    def is_alive(self, now: float | None = None) -> bool:
        return (now if now is not None else time.time()) - self.heartbeat <= WORKER_TTL_SECONDS

    def takes_own_queue(self, queue: str, now: float | None = None) -> bool:
        """Whether jobs in its own `queue` will be run by it: alive, not draining, serving it."""
        return self.is_alive(now) and self.state != "stopping" and queue in self.queues
