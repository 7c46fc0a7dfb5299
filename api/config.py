"""Settings from the environment (documented in docs/contract.md), and the shared Redis client.

`create_app(test_config)` starts from `from_env()` and lets the test config override any
key; blueprints reach Redis through `redis_conn()`, never through a module global. Where
Redis is (one URL, or Sentinel) is `workers.wire.broker`'s to read and connect to.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import redis
from flask import current_app

from api.streams.stream_hub import StreamHub
from workers import keys
from workers.wire.broker import BrokerSettings, EventsSettings, Replication

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_MAX_QUEUE = 1000
# a Responses request of the flex tier is refused (429 `flex_queue_full`) when the model's
# queues already hold this many waiting jobs (never more than LLMQ_MAX_QUEUE)
DEFAULT_FLEX_MAX_QUEUE = 100
MAX_CONTENT_LENGTH = 1024 * 1024  # 1 MiB: far above any sane prompt, far below memory trouble
REDIS_SOCKET_TIMEOUT = 2.0  # a stalled Redis turns into a 503 within ~2 s (docs/faults.md F7)
# Redis connections per API process: waiting streams hold none (api.streams.stream_hub), so these
# serve submissions and reads; a request waits up to REDIS_POOL_TIMEOUT for one.
DEFAULT_REDIS_CONNECTIONS = 32
REDIS_POOL_TIMEOUT = 10.0
PING_ENV = "LLMQ_SSE_PING_SECONDS"
DEFAULT_PING_SECONDS = 15.0


def from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    env = os.environ if environ is None else environ
    broker = BrokerSettings.from_env(env)  # REDIS_URL and REDIS_SENTINELS both set: refused
    return {
        "REDIS_URL": broker.url,  # None with Sentinels
        "BROKER": broker,
        "EVENTS": EventsSettings.from_env(env),  # the streams' Redis Cluster, if any
        "API_KEYS": _csv(env.get("LLMQ_API_KEYS", "")),
        "ADMIN_KEY": env.get("LLMQ_ADMIN_KEY") or None,
        "MAX_QUEUE": _int("LLMQ_MAX_QUEUE", env.get("LLMQ_MAX_QUEUE"), DEFAULT_MAX_QUEUE),
        "FLEX_MAX_QUEUE": _int(
            "LLMQ_FLEX_MAX_QUEUE", env.get("LLMQ_FLEX_MAX_QUEUE"), DEFAULT_FLEX_MAX_QUEUE
        ),
        # per API key (or client address) and minute; 0: off (api.rate_limits)
        "RATE_LIMIT_RPM": _limit("LLMQ_RATE_LIMIT_RPM", env.get("LLMQ_RATE_LIMIT_RPM")),
        "RATE_LIMIT_TPM": _limit("LLMQ_RATE_LIMIT_TPM", env.get("LLMQ_RATE_LIMIT_TPM")),
        "REDIS_CONNECTIONS": _positive(
            "LLMQ_API_REDIS_CONNECTIONS",
            env.get("LLMQ_API_REDIS_CONNECTIONS"),
            DEFAULT_REDIS_CONNECTIONS,
        ),
        "MAX_CONTENT_LENGTH": MAX_CONTENT_LENGTH,
        # SSE `: ping` comment after this long without an event (docs/faults.md: <= 15 s)
        "PING_SECONDS": _seconds(PING_ENV, env.get(PING_ENV), DEFAULT_PING_SECONDS),
        "SSE_RETRY_MS": 2000,
        "SYNC_TIMEOUT_SECONDS": 3600.0,  # a synchronous request waits at most this long
        "LORA_WAIT_SECONDS": 10.0,  # POST /admin/loras waits this long for a worker's load
    }


def _seconds(name: str, value: str | None, default: float) -> float:
    if value is None or not value.strip():
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{name} must be a number of seconds above 0, got {value!r}")
    return seconds


def _csv(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _int(name: str, value: str | None, default: int) -> int:
    if value is None or not value.strip():
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _limit(name: str, value: str | None) -> int:
    limit = _int(name, value, 0)
    if limit < 0:
        raise ValueError(f"{name} must be 0 (no limit) or more, got {limit}")
    return limit


def _positive(name: str, value: str | None, default: int) -> int:
    number = _int(name, value, default)
    if number < 1:
        raise ValueError(f"{name} must be 1 or more, got {number}")
    return number


def broker_settings(config: Mapping[str, Any]) -> BrokerSettings:
    """The app's broker: Sentinel when configured, else `REDIS_URL` (which a test config
    may override)."""
    broker = config.get("BROKER")
    if isinstance(broker, BrokerSettings) and broker.uses_sentinel:
        return broker
    return BrokerSettings(url=config.get("REDIS_URL") or DEFAULT_REDIS_URL)


def make_redis(
    settings: BrokerSettings, max_connections: int = DEFAULT_REDIS_CONNECTIONS
) -> redis.Redis:
    """The process's one client: at most `max_connections` connections (a bounded pool)."""
    return settings.connect(
        max_connections=max_connections,
        pool_timeout=REDIS_POOL_TIMEOUT,
        socket_timeout=REDIS_SOCKET_TIMEOUT,
        socket_connect_timeout=REDIS_SOCKET_TIMEOUT,
        health_check_interval=30,
    )


def make_events(settings: EventsSettings, queue: redis.Redis) -> Any:
    """The events cluster's client (`queue` itself without one): per node, a connection
    for each event bucket's blocking reader and a few for requests."""
    return settings.connect(
        queue,
        max_connections=keys.EVENT_BUCKETS + 8,
        socket_timeout=REDIS_SOCKET_TIMEOUT,
        socket_connect_timeout=REDIS_SOCKET_TIMEOUT,
    )


def redis_conn() -> redis.Redis:
    return current_app.extensions["redis"]


def events_conn() -> Any:
    """Where the jobs' streams are: `redis_conn()`, or the events cluster's client
    (`LLMQ_EVENTS_CLUSTER`, `workers.wire.broker.EventsSettings`)."""
    return current_app.extensions.get("events") or redis_conn()


def stream_hub() -> StreamHub:
    """The process's one reader of job streams (api.streams.stream_hub)."""
    return current_app.extensions["streams"]


def replication() -> Replication:
    """How acknowledgements wait for replicas (off without Sentinels)."""
    return current_app.extensions["replication"]
