"""The worker's share of the shared metrics (`keys.METRIC_*`), written into the pipelines the
worker sends anyway, so measuring costs no extra round trip. Never any prompt text.

`METRIC_JOBS` fields counted here: `started`, `finished`, `failed`, `cancelled` (jobs a
worker ended; the API counts the ones it cancels while queued) and `requeued`. A job that
ends through a fenced write is counted by that write itself (`scripts.append`), so each
job's end is counted exactly once even if its worker dies right after.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from workers import keys
from workers.wire.histograms import STEP_SIZE_BUCKETS, TTFT_BUCKETS, histogram_fields


def observe(pipe: Any, key: str, label: str, value: float, buckets: tuple[float, ...]) -> None:
    bucket, count, total = histogram_fields(label, value, buckets)
    pipe.hincrby(key, bucket, 1)
    pipe.hincrby(key, count, 1)
    pipe.hincrbyfloat(key, total, value)


def count_job(pipe: Any, state: str) -> None:
    pipe.hincrby(keys.METRIC_JOBS, state, 1)


def count_prompt_tokens(pipe: Any, model: str, tokens: int) -> None:
    if tokens:
        pipe.hincrby(keys.METRIC_PROMPT_TOKENS, model, tokens)


def count_prefix_cache(pipe: Any, model: str, prefilled: int, cached: int) -> None:
    """Prompt tokens sequences asked to prefill, and how many the prefix cache served."""
    if prefilled:
        pipe.hincrby(keys.METRIC_PREFIX_CACHE, f"{model}|prompt_tokens", prefilled)
    if cached:
        pipe.hincrby(keys.METRIC_PREFIX_CACHE, f"{model}|hit_tokens", cached)


def record_step(pipe: Any, step_sizes: dict[str, int], tokens: dict[str, int]) -> None:
    """One decode step: the sequences it ran per model, and the tokens they made."""
    for model, size in step_sizes.items():
        observe(pipe, keys.METRIC_STEP_SIZE, model, size, STEP_SIZE_BUCKETS)
    for model, count in tokens.items():
        if count:
            pipe.hincrby(keys.METRIC_TOKENS_GENERATED, model, count)


def record_ttft(pipe: Any, model: str, seconds: float) -> None:
    observe(pipe, keys.METRIC_TTFT, model, seconds, TTFT_BUCKETS)


class Throughput:
    """Generated tokens per second over the last `window` seconds."""

    def __init__(self, window: float = 10.0) -> None:
        self.window = window
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, tokens))
        while self._samples and self._samples[0][0] < now - self.window:
            self._samples.popleft()

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        recent = [(t, n) for t, n in self._samples if t >= now - self.window]
        if len(recent) < 2:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent[1:]) / span
