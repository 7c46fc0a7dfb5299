"""The dashboard's charts: the last minutes of `keys.METRIC_HISTORY` (samples the workers
add, `workers.history`) as points a chart draws. Samples hold cumulative counters; a point
holds what happened since the sample before it (tokens/s) or in the minute before it (TTFT
p50/p95, from the histogram's buckets as Prometheus's `histogram_quantile` reads them), and
the queue depth and running jobs at its moment. A counter that went down (Redis flushed)
gives no rate for that point, rather than a negative one."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import redis

from workers import keys
from workers.wire.defaults import HISTORY_SECONDS, HISTORY_TTFT_WINDOW_SECONDS
from workers.wire.histograms import TTFT_BUCKETS
from workers.wire.history import MetricsSample

log = logging.getLogger(__name__)


def read_samples(conn: redis.Redis, now: float | None = None) -> list[MetricsSample]:
    """The samples of the last `HISTORY_SECONDS`, oldest first (malformed ones skipped)."""
    now = time.time() if now is None else now
    start = int((now - HISTORY_SECONDS) * 1000)
    samples = []
    for entry_id, fields in conn.xrange(keys.METRIC_HISTORY, min=start):
        try:
            samples.append(MetricsSample.decode(fields))
        except ValueError as exc:
            log.warning("skipping history entry %s: %s", entry_id, exc)
    return samples


def points(samples: Sequence[MetricsSample]) -> list[dict[str, Any]]:
    """One point per sample: `time`, `tokens_per_second` (None for the first, or after a
    reset), `queue_depth`, `running_jobs`, `ttft_p50_seconds` and `ttft_p95_seconds` (None
    when no first token came in the window)."""
    out = []
    for i, sample in enumerate(samples):
        window = _window_start(samples, i)
        ttft = (
            _difference(sample.ttft_buckets, samples[window].ttft_buckets) if window < i else None
        )
        out.append(
            {
                "time": sample.time,
                "tokens_per_second": _rate(samples[i - 1], sample) if i else None,
                "queue_depth": sample.queue_depth,
                "running_jobs": sample.running_jobs,
                "ttft_p50_seconds": quantile(0.5, ttft) if ttft else None,
                "ttft_p95_seconds": quantile(0.95, ttft) if ttft else None,
            }
        )
    return out


def quantile(
    q: float, counts: Sequence[int], bounds: Sequence[float] = TTFT_BUCKETS
) -> float | None:
    """The q-quantile of observations counted per bucket (`counts[k]` in (bounds[k-1],
    bounds[k]], the last one above every bound), interpolated linearly inside its bucket;
    one in the +Inf bucket is reported as the highest bound. None without observations."""
    total = sum(counts)
    if total <= 0:
        return None
    rank, below = q * total, 0
    for k, count in enumerate(counts):
        if count and below + count >= rank:
            if k >= len(bounds):
                return float(bounds[-1])
            lower = bounds[k - 1] if k else 0.0
            return lower + (bounds[k] - lower) * (rank - below) / count
        below += count
    return float(bounds[-1])


def _window_start(samples: Sequence[MetricsSample], i: int) -> int:
    """The earliest sample at most `HISTORY_TTFT_WINDOW_SECONDS` before sample i (i itself
    when none is; then the one just before it, if any, so a point always covers a span)."""
    start = samples[i].time - HISTORY_TTFT_WINDOW_SECONDS
    j = i
    while j > 0 and samples[j - 1].time >= start:
        j -= 1
    return j if j < i else max(i - 1, 0)


def _rate(before: MetricsSample, after: MetricsSample) -> float | None:
    seconds = after.time - before.time
    tokens = after.tokens_generated - before.tokens_generated
    if seconds <= 0 or tokens < 0:
        return None
    return tokens / seconds


def _difference(after: Sequence[int], before: Sequence[int]) -> list[int] | None:
    if len(after) != len(before):
        return None  # the buckets changed between versions: no honest difference
    counts = [a - b for a, b in zip(after, before, strict=True)]
    return None if any(c < 0 for c in counts) else counts
