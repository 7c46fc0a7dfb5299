"""Histograms kept in Redis hashes: workers write observations, the API renders /metrics."""

from __future__ import annotations

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # sequences one decode step ran together


def format_bucket(bound: float) -> str:
    return f"{bound:g}"


def histogram_fields(label: str, value: float, buckets: tuple[float, ...]) -> tuple[str, str, str]:
    """Hash fields for one observation of a histogram kept in a Redis hash.

    HINCRBY the first (the bucket `value` falls in, not cumulative) and the second
    (`count`) by 1, and HINCRBYFLOAT the third (`sum`) by `value`; `label` is the model id.
    """
    bound = next((format_bucket(b) for b in buckets if value <= b), "+Inf")
    return f"{label}|{bound}", f"{label}|count", f"{label}|sum"
