"""A worker's presence and its admin commands: what it publishes about itself (state,
jobs, pool, models, throughput) and the load/unload commands the API sends it."""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import redis

from runtime.chat_template import has_chat_template
from runtime.errors import LLMQRuntimeError
from runtime.registry import load_registry
from workers import affinity, keys, loras
from workers.errors import JobFailure, PoolFull
from workers.wire.commands import COMMAND_ADAPTERS, COMMAND_LOAD
from workers.wire.loras import read_registry

if TYPE_CHECKING:
    from workers.pool import EnginePool
    from workers.presence import Presence

log = logging.getLogger("llmq.worker")


class Admin:
    """What a worker learns about its models and publishes (through `Presence`), the
    load/unload commands it obeys, and the own queues it hands back when it leaves."""

    def __init__(
        self, connection: redis.Redis, worker_name: str, pool: EnginePool, presence: Presence
    ) -> None:
        self.connection = connection
        self.worker = worker_name
        self.pool = pool
        self.presence = presence
        self._inspector: ThreadPoolExecutor | None = None
        self._inspections: dict[str, Future[bool]] = {}  # model -> has it a chat template

    def inspect_models(self) -> None:
        """Read whether each served model has a chat template from its GGUF header, in a
        thread (a header takes tens of ms; a chunked model's file may first be assembled),
        so `keys.MODELS` says it for models not loaded yet."""
        if self._inspector is not None:
            return
        self._inspector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmq-inspect")
        self._inspections = {
            model: self._inspector.submit(has_chat_template, source)
            for model, source in self.pool.sources.items()
        }

    def close(self) -> None:
        if self._inspector is not None:
            self._inspector.shutdown(wait=False, cancel_futures=True)

    def learn_models(self) -> bool:
        """Fold what loads and header reads found out into the published model info;
        True if it changed (then it is published at once, not at the next heartbeat)."""
        changed = False
        for model in self.pool.sources:
            described = self.presence.described(model)
            if described is None:
                continue
            entry = self.pool.get(model)
            if entry is not None and entry.engine is not None:
                learned = {
                    "context_length": entry.engine.context_length,
                    "chat_template": entry.engine.chat_template.available,
                }
            elif "chat_template" not in described:
                learned = self._inspected(model)
            else:
                continue
            changed = self.presence.learn(model, learned) or changed
        return changed

    def _inspected(self, model: str) -> dict[str, Any]:
        """{"chat_template": bool} once the header was read; {} before, or if it could not
        be (the model's load reports why)."""
        future = self._inspections.get(model)
        if future is None or not future.done() or future.cancelled():
            return {}
        error = future.exception()
        if error is not None:
            if not isinstance(error, LLMQRuntimeError | OSError):
                log.warning("could not read the chat template of %s: %s", model, error)
            return {}
        return {"chat_template": future.result()}

    def publish(
        self,
        state: str,
        job_ids: list[str],
        tokens_per_second: float,
        loop: dict[str, float] | None = None,
    ) -> None:
        self.learn_models()
        self.presence.publish(state, job_ids, self.pool.snapshot(), loop)
        rate = f"{tokens_per_second:.2f}"
        self.connection.hset(keys.METRIC_TOKENS_PER_SECOND, self.worker, rate)

    def sync_adapters(self) -> None:
        """Load the adapters `/admin/loras` registered on the engines of their base model,
        unload removed ones (`workers.loras`)."""
        try:
            loras.sync(self.pool, read_registry(self.connection))
        except redis.RedisError as exc:  # the next heartbeat tries again
            log.warning("worker %s: cannot read the adapter registry: %s", self.worker, exc)

    def obey(self, commands: list[tuple[str, str]]) -> None:
        for op, model in commands:
            log.info("worker %s: admin command %s %s", self.worker, op, model)
            if op == COMMAND_ADAPTERS:  # an adapter was registered or removed: sync now
                self.sync_adapters()
                continue
            try:
                if op == COMMAND_LOAD:
                    self.pool.request(model)
                else:
                    self.pool.unload(model)
            except (JobFailure, PoolFull) as exc:
                log.warning("worker %s: cannot %s %s: %s", self.worker, op, model, exc)

    def release_own_queues(self, queue_names: list[str]) -> None:
        """Jobs routed to this worker's own queues go back to the shared ones (it is leaving)."""
        for name in queue_names:
            if keys.queue_owner(name) == self.worker:
                moved = affinity.release(self.connection, name)
                if moved:
                    log.info(
                        "worker %s: moved %d job(s) from %s to the shared queue",
                        self.worker,
                        moved,
                        name,
                    )


def describe_models(sources: dict[str, str]) -> dict[str, dict[str, Any]]:
    described = {
        spec.id: {"id": spec.id, "source": spec.source, "owned_by": "llmq"}
        for spec in load_registry().values()
    }
    for spec in load_registry().values():  # the registry's adapters, for the API's checks
        if spec.loras:
            described[spec.id]["loras"] = [name for name, _ in spec.loras]
    for model, source in sources.items():
        described.setdefault(model, {"id": model, "source": source, "owned_by": "llmq"})
    return described
