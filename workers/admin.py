"""A worker's presence and its admin commands: what it publishes about itself (state,
jobs, pool, models, throughput) and the load/unload commands the API sends it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import redis

from runtime.registry import load_registry
from workers import affinity, keys, metrics
from workers.errors import JobFailure, PoolFull
from workers.wire.commands import COMMAND_LOAD

if TYPE_CHECKING:
    from workers.pool import EnginePool
    from workers.presence import Presence
    from workers.running import RunningJobs

log = logging.getLogger("llmq.worker")


class AdminDuties:
    """Mixin of `LLMQWorker`: publishing its presence, obeying admin commands, and handing
    its own queues back when it leaves."""

    name: str
    connection: redis.Redis
    pool: EnginePool
    presence: Presence
    running: RunningJobs
    _stop_now: bool
    _drain_deadline: float | None
    _throughput: metrics.Throughput

    def _publish(self) -> None:
        for model in self.pool.sources:
            entry = self.pool.get(model)
            if entry is not None and entry.engine is not None and model in self.presence.models:
                self.presence.models[model]["context_length"] = entry.engine.context_length
        if self._stop_now or self._drain_deadline is not None:
            state = "stopping"
        else:
            state = "busy" if self.running.jobs else "idle"
        self.presence.publish(state, list(self.running.jobs), self.pool.snapshot())
        rate = self._throughput.rate()
        self.connection.hset(keys.METRIC_TOKENS_PER_SECOND, self.name, f"{rate:.2f}")

    def _handle_commands(self, commands: list[tuple[str, str]]) -> None:
        for op, model in commands:
            log.info("worker %s: admin command %s %s", self.name, op, model)
            try:
                if op == COMMAND_LOAD:
                    self.pool.request(model)
                else:
                    self.pool.unload(model)
            except (JobFailure, PoolFull) as exc:
                log.warning("worker %s: cannot %s %s: %s", self.name, op, model, exc)

    def _release_own_queues(self) -> None:
        """Jobs routed to this worker's own queues go back to the shared ones (it is leaving)."""
        for name in self.queue_names():
            if keys.queue_owner(name) == self.name:
                moved = affinity.release(self.connection, name)
                if moved:
                    log.info(
                        "worker %s: moved %d job(s) from %s to the shared queue",
                        self.name,
                        moved,
                        name,
                    )


def describe_models(sources: dict[str, str]) -> dict[str, dict[str, Any]]:
    described = {
        spec.id: {"id": spec.id, "source": spec.source, "owned_by": "llmq"}
        for spec in load_registry().values()
    }
    for model, source in sources.items():
        described.setdefault(model, {"id": model, "source": source, "owned_by": "llmq"})
    return described
