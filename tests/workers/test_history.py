"""The dashboard's samples (`workers.history`) against real Redis: one per slot whichever
worker is first, the counters and gauges as they stand, a bounded stream, and a running
worker adding them by itself."""

from __future__ import annotations

import pytest
from rq import Queue

from tests.workers.conftest import wait_for
from workers import keys
from workers.history import MAX_SAMPLES, HistorySampler
from workers.wire.defaults import HISTORY_SAMPLE_SECONDS
from workers.wire.histograms import TTFT_BUCKETS, histogram_fields
from workers.wire.history import MetricsSample

pytestmark = pytest.mark.integration

T0 = 1_800_000_000.0  # a slot boundary: a multiple of HISTORY_SAMPLE_SECONDS


def test_a_slot_gets_one_sample_whichever_worker_offers_it(conn):
    a, b = HistorySampler(conn), HistorySampler(conn)
    assert a.sample(T0 + 1) is not None
    assert b.sample(T0 + 2) is None  # same slot, another worker
    assert b.sample(T0 + HISTORY_SAMPLE_SECONDS) is not None
    assert a.sample(T0 + HISTORY_SAMPLE_SECONDS + 1) is None
    ids = [entry_id.decode() for entry_id, _ in conn.xrange(keys.METRIC_HISTORY)]
    assert ids == [f"{int(T0) * 1000}-0", f"{int(T0 + HISTORY_SAMPLE_SECONDS) * 1000}-0"]


def test_a_sample_holds_the_counters_and_gauges_as_they_stand(conn):
    conn.hincrby(keys.METRIC_TOKENS_GENERATED, "m1", 7)
    conn.hincrby(keys.METRIC_TOKENS_GENERATED, "m2", 5)
    observed = [0.01, 0.3, 0.3, 99.0]
    for i, seconds in enumerate(observed):
        for field in histogram_fields(f"m{i % 2}", seconds, TTFT_BUCKETS)[:2]:
            conn.hincrby(keys.METRIC_TTFT, field, 1)
    conn.sadd(keys.RUNNING, "j1", "j2")
    for name, jobs in ((keys.queue_name("m1"), 3), (keys.personal_queue_name("m1", "w"), 1)):
        queue = Queue(name, connection=conn)
        conn.sadd(Queue.redis_queues_keys, queue.key)
        conn.rpush(queue.key, *[f"job{k}" for k in range(jobs)])
    other = Queue("not-llmq", connection=conn)  # a queue of something else on this Redis
    conn.sadd(Queue.redis_queues_keys, other.key)
    conn.rpush(other.key, "x")
    sample = HistorySampler(conn).sample(T0)
    assert sample is not None
    assert (sample.tokens_generated, sample.queue_depth, sample.running_jobs) == (12, 4, 2)
    expected = [
        sum(1 for s in observed if lo < s <= hi)
        for lo, hi in zip((0, *TTFT_BUCKETS[:-1]), TTFT_BUCKETS, strict=True)
    ]
    assert list(sample.ttft_buckets) == [*expected, 1]  # 99 s: past the last bound
    [(_, fields)] = conn.xrange(keys.METRIC_HISTORY)
    assert MetricsSample.decode(fields) == sample


def test_the_stream_keeps_only_the_last_samples(conn):
    sampler = HistorySampler(conn)
    for k in range(MAX_SAMPLES + 5):
        sampler.sample(T0 + k * HISTORY_SAMPLE_SECONDS)
    assert conn.xlen(keys.METRIC_HISTORY) == MAX_SAMPLES
    [(first, _)] = conn.xrange(keys.METRIC_HISTORY, count=1)
    assert first.decode() == f"{int(T0 + 5 * HISTORY_SAMPLE_SECONDS) * 1000}-0"


def test_a_running_worker_adds_samples(conn, start_worker):
    start_worker()
    wait_for(lambda: conn.xlen(keys.METRIC_HISTORY) >= 2, 2 * HISTORY_SAMPLE_SECONDS + 5)
