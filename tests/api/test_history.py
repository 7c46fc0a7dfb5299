"""The dashboard's history (`api.history`, `GET /admin/history`): percentiles from histogram
buckets, rates from cumulative samples, and the endpoint over samples the workers' sampler
wrote (fakeredis)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from api.history import points, quantile
from workers import keys
from workers.history import HistorySampler
from workers.wire.histograms import TTFT_BUCKETS, histogram_fields
from workers.wire.history import MetricsSample

BOUNDS = (0.1, 0.5, 1.0, 2.0)


def bucket_counts(values: np.ndarray, bounds=BOUNDS) -> list[int]:
    """Observations per bucket as the workers count them (`histogram_fields`)."""
    names = [f"m|{b:g}" for b in bounds] + ["m|+Inf"]
    counts = dict.fromkeys(names, 0)
    for value in values:
        counts[histogram_fields("m", float(value), bounds)[0]] += 1
    return [counts[n] for n in names]


@pytest.mark.parametrize("q", [0.5, 0.95])
def test_quantiles_of_values_spread_evenly_in_their_buckets_match_the_values(q):
    rng = np.random.default_rng(7)
    # uniform inside each bucket: then linear interpolation is exact up to sampling noise
    values = np.concatenate(
        [rng.uniform(lo, hi, n) for lo, hi, n in ((0, 0.1, 300), (0.5, 1.0, 900), (1.0, 2.0, 800))]
    )
    estimate = quantile(q, bucket_counts(values), BOUNDS)
    assert estimate == pytest.approx(float(np.quantile(values, q)), abs=0.02)


def test_quantiles_past_the_last_bound_and_without_observations():
    assert quantile(0.5, bucket_counts(np.array([5.0, 6.0])), BOUNDS) == BOUNDS[-1]
    assert quantile(0.95, [0, 0, 0, 0, 0], BOUNDS) is None


def sample(t: float, tokens: int, ttft: list[float], queued: int = 0, running: int = 0):
    return MetricsSample(
        t, tokens, queued, running, tuple(bucket_counts(np.array(ttft), TTFT_BUCKETS))
    )


def test_points_hold_rates_since_the_sample_before_and_ttft_over_the_minute_before():
    early, late = [0.02] * 10, [3.0, 3.0, 3.0, 3.0]  # first tokens: 10 fast, long ago; 4 slow
    samples = [
        sample(1000.0, 0, []),
        sample(1005.0, 50, early, queued=3, running=2),
        sample(1010.0, 150, early, queued=1, running=1),
        sample(1080.0, 150, early + late),  # the fast ones are now over a minute old
        sample(1085.0, 20, early + late),  # counters reset (Redis flushed): no rate
    ]
    got = points(samples)
    assert [p["tokens_per_second"] for p in got] == [None, 50 / 5, 100 / 5, 0.0, None]
    assert [(p["queue_depth"], p["running_jobs"]) for p in got][:3] == [(0, 0), (3, 2), (1, 1)]
    assert got[0]["ttft_p50_seconds"] is None  # nothing before it
    assert 0 < got[1]["ttft_p50_seconds"] <= 0.025  # the 10 fast ones, in the first bucket
    assert got[2]["ttft_p50_seconds"] == got[1]["ttft_p50_seconds"]
    # at 1080 the minute before holds only the 4 slow ones (from the sample at 1010 on)
    assert 2.5 < got[3]["ttft_p50_seconds"] <= 5.0 and 2.5 < got[3]["ttft_p95_seconds"] <= 5.0
    assert got[4]["ttft_p50_seconds"] is None  # none came in the 5 s before it


def test_the_endpoint_serves_what_the_sampler_wrote(client, fake_redis):
    now = time.time()
    sampler = HistorySampler(fake_redis)
    first = sampler.sample(now - 10)
    assert first is not None and first.tokens_generated == 0
    assert sampler.sample(now - 10) is None  # once per slot
    fake_redis.hincrby(keys.METRIC_TOKENS_GENERATED, "tiny", 30)
    fake_redis.hincrby(keys.METRIC_TOKENS_GENERATED, "other", 10)
    for field in histogram_fields("tiny", 0.3, TTFT_BUCKETS)[:2]:
        fake_redis.hincrby(keys.METRIC_TTFT, field, 1)
    second = HistorySampler(fake_redis).sample(now - 5)  # another worker, the next slot
    assert second is not None and second.tokens_generated == 40
    body = client.get("/admin/history").get_json()
    assert body["object"] == "list" and body["interval_seconds"] == 5
    assert [p["time"] for p in body["data"]] == [now - 10, now - 5]
    expected_rate = 40 / ((now - 5) - (now - 10))
    assert body["data"][1]["tokens_per_second"] == pytest.approx(expected_rate)
    assert 0.25 < body["data"][1]["ttft_p50_seconds"] <= 0.5  # its bucket
    assert body["data"][1]["queue_depth"] == 1  # the job the fake worker holds queued


@pytest.fixture
def client(app, fake_redis):
    """One queued job (the registered fake worker never takes it)."""
    test_client = app.test_client()
    job = {"model": "tiny", "prompt": "hi"}
    assert (
        test_client.post(
            "/v1/completions", json=job, headers={"Prefer": "respond-async"}
        ).status_code
        == 202
    )
    return test_client
