"""The outbox dispatcher of `llmq webhooks`: outbox entries -> RQ delivery jobs.

The dispatcher reads `keys.WEBHOOK_OUTBOX` with a consumer group (XREADGROUP BLOCK; its own
pending entries first after a claim or an error, XAUTOCLAIM for those another dispatcher
has held for a minute), and for each entry and each endpoint subscribed to its event type
enqueues one RQ job on `keys.WEBHOOK_QUEUE` with a deterministic id (`delivery_id`, enqueued
with RQ's atomic `unique`: a re-dispatch finds the job and enqueues nothing), then XACKs and
XDELs the entry. The RQ job (`deliver`, workers/webhooks/delivery.py) signs and POSTs; RQ's
`Retry` reschedules a failure (`wire.webhook_jobs.WebhookSettings`), and a delivery that
failed its last attempt stays in the queue's FailedJobRegistry: the dead-letter list
(`wire.webhook_jobs.redeliver`). The process that runs the dispatcher's thread beside the
delivering RQ worker is workers/webhooks/process.py.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
from typing import Any

import redis
from rq.exceptions import DuplicateJobError

from workers import keys
from workers.wire.webhook_jobs import WebhookSettings, webhook_queue
from workers.wire.webhooks import (
    NOTIFY_BATCH,
    OutboxEntry,
    all_endpoints,
    batch_event_type,
    event_body,
    response_event_type,
)

log = logging.getLogger("llmq.webhooks")

DELIVER_FUNCTION = "workers.webhooks.delivery.deliver"  # all that process.WebhookWorker runs
RESULT_TTL_SECONDS = 2 * 24 * 3600  # a delivered job's id stays: a re-dispatch finds it
DEAD_TTL_SECONDS = 30 * 24 * 3600  # the dead-letter list keeps a delivery a month
CLAIM_IDLE_MS = 60_000  # a live dispatcher's entry unacknowledged this long is taken


def delivery_id(event_id: str, endpoint_id: str) -> str:
    """The RQ job of one event to one endpoint (RQ's id alphabet)."""
    return f"whd_{event_id.removeprefix('evt_')}_{endpoint_id}"


class Dispatcher:
    """Outbox entries -> one RQ delivery job per subscribed endpoint, then XACK + XDEL."""

    def __init__(
        self,
        conn: redis.Redis,
        settings: WebhookSettings,
        consumer: str | None = None,
        block_ms: int = 1000,
    ) -> None:
        self.conn = conn
        self.settings = settings
        self.queue = webhook_queue(conn)
        self.consumer = consumer or worker_name()  # its process's lease is under this name
        self.block_ms = block_ms
        self.own_pending = True  # set when entries were claimed for this consumer

    def ensure_group(self) -> None:
        try:
            self.conn.xgroup_create(
                keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_GROUP, "0", mkstream=True
            )
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def run_once(self) -> int:
        """Dispatch what waits (blocking up to `block_ms` when nothing does); how many."""
        entries = self._claimed() or self._read()
        for entry_id, fields in entries:
            self.dispatch(OutboxEntry.from_entry(entry_id, fields or {}))
            with self.conn.pipeline() as pipe:
                pipe.xack(keys.WEBHOOK_OUTBOX, keys.WEBHOOK_OUTBOX_GROUP, entry_id)
                pipe.xdel(keys.WEBHOOK_OUTBOX, entry_id)
                pipe.execute()
        return len(entries)

    def _claimed(self) -> list[Any]:
        if self.own_pending:  # claimed from a dead dispatcher, or left by an error here
            got = self.conn.xreadgroup(
                keys.WEBHOOK_OUTBOX_GROUP, self.consumer, {keys.WEBHOOK_OUTBOX: "0"}, count=100
            )
            pending = got[0][1] if got else []
            self.own_pending = bool(pending)
            if pending:
                return pending
        reply = self.conn.xautoclaim(
            keys.WEBHOOK_OUTBOX,
            keys.WEBHOOK_OUTBOX_GROUP,
            self.consumer,
            CLAIM_IDLE_MS,
            "0-0",
            count=100,
        )
        return [e for e in reply[1] if e[1] is not None] if reply else []

    def _read(self) -> list[Any]:
        got = self.conn.xreadgroup(
            keys.WEBHOOK_OUTBOX_GROUP,
            self.consumer,
            {keys.WEBHOOK_OUTBOX: ">"},
            count=100,
            block=self.block_ms,
        )
        return got[0][1] if got else []

    def event_type(self, entry: OutboxEntry) -> str | None:
        """The entry's event type: a response's from the final status its entry carries; an
        entry written before the terminal write carried it reads the job's result."""
        if entry.kind == NOTIFY_BATCH:
            return batch_event_type(entry.status)
        result = None
        if not entry.response_status and entry.status == "finished":
            raw = self.conn.hget(keys.job(entry.id), "result")
            result = _json_object(raw)
        return response_event_type(entry.status, result, entry.response_status)

    def dispatch(self, entry: OutboxEntry) -> list[str]:
        """Enqueue the entry's deliveries; the ids of those enqueued now."""
        event_type = self.event_type(entry)
        if event_type is None:
            log.warning(
                "outbox entry %s: no event for %s %s", entry.entry_id, entry.kind, entry.status
            )
            return []
        event = event_body(event_type, entry.id, entry.at_ms // 1000)
        enqueued = []
        for endpoint in all_endpoints(self.conn):
            if event_type not in endpoint.events:
                continue
            job_id = delivery_id(event["id"], endpoint.id)
            try:
                self.queue.enqueue(
                    DELIVER_FUNCTION,
                    endpoint.id,
                    event,
                    entry.at_ms,
                    job_id=job_id,
                    unique=True,  # one script: checked, saved and pushed at once
                    retry=self.settings.retry(),
                    job_timeout=int(self.settings.timeout) + 10,
                    result_ttl=RESULT_TTL_SECONDS,
                    failure_ttl=DEAD_TTL_SECONDS,
                    description=f"webhook {event_type} {event['id']} -> {endpoint.id}",
                    meta={"attempts": len(self.settings.intervals) + 1},
                )
            except DuplicateJobError:
                continue  # dispatched before (this entry again, or its end written twice)
            enqueued.append(job_id)
        return enqueued


def _json_object(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def worker_name() -> str:
    """A name no other start of a process shares (a restarted container may reuse its host
    name and pid): the RQ worker's, the outbox consumer's and the lease's."""
    return f"webhooks.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}"
