"""The history behind the dashboard's charts: every worker offers a sample of the shared
metrics each `HISTORY_SAMPLE_SECONDS`, and the first one in each slot adds it to
`keys.METRIC_HISTORY` (a stream bounded to `HISTORY_SECONDS` of samples). Workers take it,
not the API, because they always run while there is anything to chart, and no page needs to
be open for the history to exist. Two round trips per slot per worker; never prompt text."""

from __future__ import annotations

import logging
import time

import redis
from rq import Queue

from workers import keys
from workers.wire.defaults import HISTORY_SAMPLE_SECONDS, HISTORY_SECONDS
from workers.wire.histograms import TTFT_BUCKETS, format_bucket
from workers.wire.history import MetricsSample
from workers.wire.queues import llmq_queue_names, queue_lengths
from workers.wire.text import as_str

log = logging.getLogger("llmq.history")

MAX_SAMPLES = HISTORY_SECONDS // HISTORY_SAMPLE_SECONDS


class HistorySampler:
    """Adds this slot's sample unless a worker already has (`sample`)."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self._last_slot = ""  # the slot this worker last sampled (or saw sampled)

    def sample(self, now: float | None = None) -> MetricsSample | None:
        """The sample added now, or None when this slot has one already."""
        now = time.time() if now is None else now
        slot = MetricsSample(now, 0, 0, 0, ()).slot_id()
        if slot == self._last_slot:
            return None
        self._last_slot = slot
        with self.conn.pipeline(transaction=False) as pipe:
            pipe.xrevrange(keys.METRIC_HISTORY, count=1)
            pipe.hgetall(keys.METRIC_TOKENS_GENERATED)
            pipe.hgetall(keys.METRIC_TTFT)
            pipe.scard(keys.RUNNING)
            pipe.smembers(Queue.redis_queues_keys)
            last, tokens, ttft, running, queue_keys = pipe.execute()
        if last and _id_ms(last[0][0]) >= _id_ms(slot):
            return None  # another worker was first
        sample = MetricsSample(
            time=now,
            tokens_generated=sum(int(n) for n in tokens.values()),
            queue_depth=self._queue_depth(queue_keys),
            running_jobs=int(running),
            ttft_buckets=_ttft_buckets(ttft),
        )
        try:
            self.conn.xadd(
                keys.METRIC_HISTORY, sample.encode(), id=slot, maxlen=MAX_SAMPLES, approximate=False
            )
        except redis.ResponseError:  # another worker added this slot's sample meanwhile
            return None
        return sample

    def _queue_depth(self, queue_keys: set[bytes]) -> int:
        """Jobs waiting on every llmq queue (shared, priority levels and workers' own)."""
        return sum(queue_lengths(self.conn, llmq_queue_names(queue_keys)).values())


def _ttft_buckets(fields: dict[bytes, bytes]) -> tuple[int, ...]:
    """First tokens per TTFT bucket (+Inf last), summed over the models."""
    bounds = [format_bucket(b) for b in TTFT_BUCKETS] + ["+Inf"]
    counts = dict.fromkeys(bounds, 0)
    for field, value in fields.items():
        bound = as_str(field).rpartition("|")[2]
        if bound in counts:
            counts[bound] += int(float(as_str(value)))
    return tuple(counts[b] for b in bounds)


def _id_ms(entry_id: bytes | str) -> int:
    return int(as_str(entry_id).split("-", 1)[0])
