"""A LoRA registration answers once the adapter is usable (`POST /admin/loras`).

Workers load what `keys.LORAS` names at each heartbeat (`workers.loras.sync`), so a request
naming a just-registered adapter could reach a worker before that. Instead, the API tells
every live worker serving the base model to sync now (`COMMAND_ADAPTERS` on its command
list: an idle worker blocks on that list, a busy one reads it between steps) and waits, at
most `LORA_WAIT_SECONDS`, for the workers holding the base model loaded to report this
registration's state in their pool (a worker publishes a pool change at once):

- one reports it ready: requests may name it now -> `ready` (201);
- every one reports it failed: it cannot be used -> `failed` (the registration is withdrawn,
  400 with the workers' reasons);
- no live worker holds the base model loaded, or the wait ends first -> `pending` (202):
  registered; a worker loads it before it plans a job naming it, or at its next heartbeat.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import redis

from api import store
from workers.wire.commands import COMMAND_ADAPTERS, push_command
from workers.wire.worker_info import READY as MODEL_READY
from workers.wire.worker_info import WorkerInfo

READY, PENDING, FAILED = "ready", "pending", "failed"
POLL_SECONDS = 0.05


@dataclass
class AdapterStates:
    """One adapter's state on each live worker holding its base model loaded, and overall:
    ready on one of them, failed on all of them, else pending."""

    workers: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def state(self) -> str:
        states = {s.get("state") for s in self.workers.values()}
        if READY in states:
            return READY
        return FAILED if states == {FAILED} else PENDING

    def errors(self) -> str:
        return "; ".join(
            f"worker {name}: {s.get('error') or 'failed'}"
            for name, s in sorted(self.workers.items())
            if s.get("state") == FAILED
        )


def adapter_states(workers: list[WorkerInfo], entry: dict[str, Any]) -> AdapterStates:
    """The state `entry` (a `keys.LORAS` entry, or a registry TOML's adapter) has on each
    of `workers` whose pool holds its base model ready. A state a worker reports about an
    earlier registration of the name counts as pending."""
    out = AdapterStates()
    for worker in workers:
        pool = worker.pool.get(entry["base_model"], {})
        if pool.get("state") != MODEL_READY:
            continue  # it loads the adapter with the model (at its next sync)
        state = (pool.get("loras") or {}).get(entry["name"], {"state": PENDING})
        if state.get("registered_at") != entry.get("registered_at"):
            state = {"state": PENDING}
        out.workers[worker.name] = state
    return out


class AdapterRollout:
    """Tells the workers serving an adapter's base model that the registry changed, and
    waits (bounded) until one of them can run requests naming it."""

    def __init__(self, conn: redis.Redis, entry: dict[str, Any], wait_seconds: float) -> None:
        self.conn = conn
        self.entry = entry
        self.wait_seconds = wait_seconds

    def announce(self) -> list[str]:
        """Send `COMMAND_ADAPTERS` to every live worker serving the base model; their names."""
        base = self.entry["base_model"]
        targets = [w.name for w in store.live_workers(self.conn) if self._serves(w, base)]
        if targets:
            pipe = self.conn.pipeline(transaction=False)
            for name in targets:
                push_command(pipe, name, COMMAND_ADAPTERS, base)
            pipe.execute()
        return targets

    def wait(self) -> AdapterStates:
        """The adapter's states once it is ready or failed everywhere it can load, or when
        `wait_seconds` have passed; at once when no live worker holds the base model."""
        deadline = time.monotonic() + self.wait_seconds
        while True:
            states = adapter_states(store.live_workers(self.conn), self.entry)
            if not states.workers or states.state != PENDING or time.monotonic() >= deadline:
                return states
            time.sleep(POLL_SECONDS)

    @staticmethod
    def _serves(worker: WorkerInfo, model: str) -> bool:
        return model in worker.models or model in worker.pool
