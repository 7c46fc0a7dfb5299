"""Prometheus metrics kept in Redis and rendered by a custom collector.

Counters live in Redis hashes (`keys.METRIC_*`) rather than in process memory: gunicorn
runs several API processes and the workers are other processes (or machines), and each
scrape must see the sum of all of them. The API adds request counts (once a second,
api/request_counts.py); workers increment token counts and histogram buckets
(`wire.histograms.histogram_fields`). A scrape costs one pipelined round trip.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator

import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from rq import Queue

from api.streams.stream_hub import StreamHub
from workers import keys
from workers.wire.broker import BoundedPool, replication_state
from workers.wire.histograms import STEP_SIZE_BUCKETS, TTFT_BUCKETS, format_bucket
from workers.wire.queues import llmq_queue_names, queue_lengths
from workers.wire.worker_info import WorkerInfo

log = logging.getLogger(__name__)


def _hash(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


def _num(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        return 0.0


class RedisCollector(Collector):
    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn

    def collect(self) -> Iterator[Metric]:
        pipe = self.conn.pipeline(transaction=False)
        names = [
            keys.METRIC_REQUESTS,
            keys.METRIC_JOBS,
            keys.METRIC_TOKENS_GENERATED,
            keys.METRIC_PROMPT_TOKENS,
            keys.METRIC_TTFT,
            keys.METRIC_STEP_SIZE,
            keys.METRIC_TOKENS_PER_SECOND,
            keys.METRIC_PREFIX_CACHE,
        ]
        for name in names:
            pipe.hgetall(name)
        pipe.smembers(Queue.redis_queues_keys)
        pipe.scard(keys.RUNNING)
        pipe.smembers(keys.WORKERS)
        *hashes, queue_keys, running, worker_names = pipe.execute()
        h = dict(zip(names, (_hash(x) for x in hashes), strict=True))

        yield self._requests(h[keys.METRIC_REQUESTS])
        jobs = CounterMetricFamily("llmq_jobs", "Jobs that reached each state.", labels=["state"])
        for state, count in sorted(h[keys.METRIC_JOBS].items()):
            jobs.add_metric([state], _num(count))
        yield jobs
        yield from self._per_model(h)
        yield self._histogram(
            "llmq_time_to_first_token_seconds",
            "Time from job start to its first token.",
            h[keys.METRIC_TTFT],
            TTFT_BUCKETS,
        )
        yield self._histogram(
            "llmq_batch_size",
            "Sequences per decode step.",
            h[keys.METRIC_STEP_SIZE],
            STEP_SIZE_BUCKETS,
        )
        yield from self._queues(queue_keys)
        yield GaugeMetricFamily("llmq_jobs_running", "Jobs being generated now.", value=running)
        yield from self._workers(worker_names, h[keys.METRIC_TOKENS_PER_SECOND])
        yield from self._broker()

    def _broker(self) -> Iterable[Metric]:
        """Which master this process writes to and how many replicas it has (a failover
        changes the label; `wire.broker`)."""
        state = replication_state(self.conn)
        master = GaugeMetricFamily(
            "llmq_redis_master",
            "The Redis master in use (1), by address and whether Sentinel found it.",
            labels=["master", "sentinel"],
        )
        master.add_metric([state.master, str(state.sentinel).lower()], 1)
        yield master
        yield GaugeMetricFamily(
            "llmq_redis_connected_replicas",
            "Replicas connected to the Redis master in use.",
            value=state.replicas,
        )

    @staticmethod
    def _requests(counts: dict[str, str]) -> Metric:
        family = CounterMetricFamily(
            "llmq_http_requests", "HTTP requests answered.", labels=["method", "route", "status"]
        )
        for field, count in sorted(counts.items()):
            label, _, status = field.rpartition("|")
            method, _, route = label.partition(" ")
            family.add_metric([method, route, status], _num(count))
        return family

    @staticmethod
    def _per_model(h: dict[str, dict[str, str]]) -> Iterable[Metric]:
        for key, name, doc in (
            (keys.METRIC_TOKENS_GENERATED, "llmq_tokens_generated", "Tokens generated."),
            (keys.METRIC_PROMPT_TOKENS, "llmq_prompt_tokens", "Prompt tokens processed."),
        ):
            family = CounterMetricFamily(name, doc, labels=["model"])
            for model, count in sorted(h[key].items()):
                family.add_metric([model], _num(count))
            yield family
        cache = h[keys.METRIC_PREFIX_CACHE]
        ratio = GaugeMetricFamily(
            "llmq_prefix_cache_hit_ratio",
            "Share of prompt tokens served from the prefix cache.",
            labels=["model"],
        )
        for field, total in sorted(cache.items()):
            model, _, kind = field.rpartition("|")
            if kind == "prompt_tokens" and _num(total) > 0:
                hits = _num(cache.get(f"{model}|hit_tokens", "0"))
                ratio.add_metric([model], hits / _num(total))
        yield ratio

    @staticmethod
    def _histogram(
        name: str, doc: str, fields: dict[str, str], buckets: tuple[float, ...]
    ) -> Metric:
        family = HistogramMetricFamily(name, doc, labels=["model"])
        models = sorted({f.rpartition("|")[0] for f in fields})
        for model in models:
            cumulative, rows = 0.0, []
            for bound in buckets:
                cumulative += _num(fields.get(f"{model}|{format_bucket(bound)}", "0"))
                rows.append((format_bucket(bound), cumulative))
            cumulative += _num(fields.get(f"{model}|+Inf", "0"))
            rows.append(("+Inf", max(cumulative, _num(fields.get(f"{model}|count", "0")))))
            family.add_metric([model], rows, sum_value=_num(fields.get(f"{model}|sum", "0")))
        return family

    def _queues(self, queue_keys: set[bytes]) -> Iterable[Metric]:
        depth = GaugeMetricFamily("llmq_queue_depth", "Jobs waiting per queue.", labels=["queue"])
        for name, length in queue_lengths(self.conn, llmq_queue_names(queue_keys)).items():
            depth.add_metric([name], length)
        yield depth

    def _workers(self, names: set[bytes], rates: dict[str, str]) -> Iterable[Metric]:
        pipe = self.conn.pipeline(transaction=False)
        ordered = sorted(n.decode() for n in names)
        for name in ordered:
            pipe.hgetall(keys.worker(name))
        now, live = time.time(), []
        for raw in pipe.execute():
            try:
                info = WorkerInfo.from_hash(raw) if raw else None
            except (KeyError, ValueError):
                info = None
            if info is not None and info.is_alive(now):
                live.append(info.name)
        yield GaugeMetricFamily("llmq_workers_live", "Workers with a fresh heartbeat.", len(live))
        tps = GaugeMetricFamily(
            "llmq_tokens_per_second", "Recent decode throughput per worker.", labels=["worker"]
        )
        for name in live:
            tps.add_metric([name], _num(rates.get(name, "0")))
        yield tps


class ProcessCollector(Collector):
    """What the API process that answers the scrape holds now (label `pid`): its Redis
    connections against their bound (`LLMQ_API_REDIS_CONNECTIONS`) and its open streams
    (api/streams/stream_hub.py). Each process answers for itself; a scrape reaches one of them."""

    def __init__(self, conn: redis.Redis, streams: StreamHub | None) -> None:
        self.conn, self.streams = conn, streams

    def collect(self) -> Iterator[Metric]:
        pid = [str(os.getpid())]
        pools = [self.conn.connection_pool]
        if self.streams is not None and self.streams.conn.connection_pool is not pools[0]:
            pools.append(self.streams.conn.connection_pool)  # the stream readers' own
        bounded = [p for p in pools if isinstance(p, BoundedPool)]
        for name, doc, value in (
            (
                "llmq_api_redis_connections_max",
                "Redis connections this API process may open (LLMQ_API_REDIS_CONNECTIONS "
                "for requests, plus its stream readers').",
                sum(p.max_connections for p in bounded) if bounded else None,
            ),
            (
                "llmq_api_redis_connections_in_use",
                "Redis connections of this API process handed out now.",
                sum(p.in_use() for p in bounded) if bounded else None,
            ),
            (
                "llmq_api_redis_connections_open",
                "Redis connections this API process has open (in use or idle).",
                sum(len(p._connections) for p in bounded) if bounded else None,
            ),
            (
                "llmq_api_streams_open",
                "Clients of this API process waiting on a job's events (streams, sync calls).",
                self.streams.open if self.streams is not None else None,
            ),
            (
                "llmq_api_events_connections_open",
                "Connections this API process has open to the events cluster's nodes "
                "(LLMQ_EVENTS_CLUSTER; at most one blocking reader a followed event bucket).",
                self._events_open(),
            ),
        ):
            if value is None:
                continue
            family = GaugeMetricFamily(name, doc, labels=["pid"])
            family.add_metric(pid, value)
            yield family

    def _events_open(self) -> int | None:
        if self.streams is None:
            return None
        return self.streams.placement.cluster_connections()


def render(conn: redis.Redis, streams: StreamHub | None = None) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RedisCollector(conn))
    registry.register(ProcessCollector(conn, streams))
    return generate_latest(registry)
