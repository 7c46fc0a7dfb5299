"""The webhook queue's RQ side that the API and `llmq webhooks` share: the delivery
settings (`LLMQ_WEBHOOK_*`), the queue, and its dead-letter list (RQ's FailedJobRegistry of
`keys.WEBHOOK_QUEUE`: deliveries that failed their last attempt) with `redeliver`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue, Retry
from rq.job import Job
from rq.registry import FailedJobRegistry
from rq.serializers import JSONSerializer

from workers import keys

# 1, 2, 4 ... 2048 s (4095 s, ~68 min, in all), then hourly: 35 retries, 36 attempts in
# ~24 h 8 min from the first
DEFAULT_INTERVALS = tuple([2**i for i in range(12)] + [3600] * 23)
DEFAULT_TIMEOUT_SECONDS = 10.0


class WebhookSettingsError(ValueError):
    """An LLMQ_WEBHOOK_* variable that cannot be read."""


@dataclass(frozen=True)
class WebhookSettings:
    """`LLMQ_WEBHOOK_TIMEOUT_SECONDS` (each POST), `LLMQ_WEBHOOK_RETRY_INTERVALS` (comma-
    separated seconds between attempts; its last repeats for no more), `LLMQ_WEBHOOK_ALLOW`
    (hosts or CIDRs that may be private, loopback ...: workers/webhooks/delivery.py)."""

    timeout: float = DEFAULT_TIMEOUT_SECONDS
    intervals: tuple[int, ...] = DEFAULT_INTERVALS
    allow: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, environ: Any = None) -> WebhookSettings:
        env = os.environ if environ is None else environ
        try:
            timeout = float(env.get("LLMQ_WEBHOOK_TIMEOUT_SECONDS") or DEFAULT_TIMEOUT_SECONDS)
            raw = env.get("LLMQ_WEBHOOK_RETRY_INTERVALS", "").strip()
            intervals = tuple(int(x) for x in raw.split(",") if x.strip()) if raw else None
        except ValueError as exc:
            raise WebhookSettingsError(f"LLMQ_WEBHOOK_*: {exc}") from None
        if not timeout > 0 or (intervals is not None and any(i < 0 for i in intervals)):
            raise WebhookSettingsError(
                "LLMQ_WEBHOOK_TIMEOUT_SECONDS must be > 0 and LLMQ_WEBHOOK_RETRY_INTERVALS "
                "seconds >= 0"
            )
        allow = tuple(a.strip() for a in env.get("LLMQ_WEBHOOK_ALLOW", "").split(",") if a.strip())
        return cls(timeout, DEFAULT_INTERVALS if intervals is None else intervals, allow)

    def retry(self) -> Retry | None:
        return (
            Retry(max=len(self.intervals), interval=list(self.intervals))
            if self.intervals
            else None
        )


def webhook_queue(conn: redis.Redis) -> Queue:
    return Queue(keys.WEBHOOK_QUEUE, connection=conn, serializer=JSONSerializer)


def dead_deliveries(conn: redis.Redis) -> list[Job]:
    """Deliveries that failed their last attempt, newest first."""
    registry = FailedJobRegistry(queue=webhook_queue(conn))
    ids = registry.get_job_ids(desc=True)
    return [j for j in Job.fetch_many(ids, connection=conn, serializer=JSONSerializer) if j]


def redeliver(conn: redis.Redis, job_id: str, settings: WebhookSettings | None = None) -> bool:
    """Send a dead delivery again, with its full retry schedule; False if it is not dead."""
    registry = FailedJobRegistry(queue=webhook_queue(conn))
    if job_id not in registry:
        return False
    settings = settings or WebhookSettings.from_env()
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    job.retries_left = len(settings.intervals)
    job.retry_intervals = list(settings.intervals) or None
    job.meta["attempts"] = len(settings.intervals) + 1
    job.meta["redelivered"] = int(job.meta.get("redelivered", 0)) + 1
    job.save()
    registry.requeue(job)
    return True
