"""One sample of the shared metrics, as the dashboard's charts keep them
(`keys.METRIC_HISTORY`, a stream): workers add one every `HISTORY_SAMPLE_SECONDS`
(`workers.history`), the API turns consecutive samples into rates and percentiles
(`api.history`). Counters are cumulative, as in `keys.METRIC_*`: a sample missed or taken
late loses nothing, and the API takes differences."""

from __future__ import annotations

import json
from dataclasses import dataclass

from workers.wire.defaults import HISTORY_SAMPLE_SECONDS
from workers.wire.text import text_hash


@dataclass(frozen=True)
class MetricsSample:
    """`time` (Unix seconds) it was taken; `tokens_generated` and `ttft_buckets` (first
    tokens per `wire.histograms.TTFT_BUCKETS` bucket, not cumulative, the +Inf bucket last)
    counted since the counters began, over every model; `queue_depth` (jobs waiting on every
    llmq queue) and `running_jobs` at that moment."""

    time: float
    tokens_generated: int
    queue_depth: int
    running_jobs: int
    ttft_buckets: tuple[int, ...]

    def slot_id(self) -> str:
        """The stream entry id: the start of its sampling slot, in ms. Redis refuses an id
        not above the last one, so a slot gets one sample whichever worker adds it first."""
        slot = int(self.time // HISTORY_SAMPLE_SECONDS) * HISTORY_SAMPLE_SECONDS
        return f"{slot * 1000}-0"

    def encode(self) -> dict[str, str]:
        """The one encoder: the stream entry's fields."""
        return {
            "time": repr(self.time),
            "tokens_generated": str(self.tokens_generated),
            "queue_depth": str(self.queue_depth),
            "running_jobs": str(self.running_jobs),
            "ttft_buckets": json.dumps(list(self.ttft_buckets)),
        }

    @classmethod
    def decode(cls, fields: dict[bytes | str, bytes | str]) -> MetricsSample:
        """The one decoder; ValueError if the entry is not a sample."""
        h = text_hash(fields)
        try:
            buckets = json.loads(h["ttft_buckets"])
            if not isinstance(buckets, list):
                raise ValueError("ttft_buckets is not a list")
            return cls(
                time=float(h["time"]),
                tokens_generated=int(h["tokens_generated"]),
                queue_depth=int(h["queue_depth"]),
                running_jobs=int(h["running_jobs"]),
                ttft_buckets=tuple(int(n) for n in buckets),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a metrics sample: {exc}") from exc
