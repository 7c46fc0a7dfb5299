"""`workers.wire.broker`: where Redis is read from the environment (one URL or Sentinel, never
both), credentials and TLS reach the right connections, and `WAIT` refuses what the replicas
did not confirm (against a real Redis without replicas: nothing can confirm)."""

from __future__ import annotations

import time

import fakeredis
import pytest
import redis
from redis.sentinel import SentinelConnectionPool, SentinelManagedSSLConnection

from llmq.cli import main
from workers import keys
from workers.config import ConfigError, WorkerConfig
from workers.errors import ServeError
from workers.supervisor import Broker, ServeConfig, free_port, serve
from workers.wire.broker import (
    DEFAULT_MASTER_NAME,
    DEFAULT_URL,
    BrokerConfigError,
    BrokerSettings,
    NotReplicated,
    Replication,
    redact,
    replication_state,
)

SENTINELS = "10.0.0.1:26379,10.0.0.2:26380"


def test_one_url_and_nothing_set_mean_one_redis() -> None:
    assert BrokerSettings.from_env({}).url == DEFAULT_URL
    settings = BrokerSettings.from_env({"REDIS_URL": "redis://h:1/2"})
    assert (settings.url, settings.uses_sentinel) == ("redis://h:1/2", False)
    assert BrokerSettings.from_env({}, url="redis://x:9/0").url == "redis://x:9/0"
    assert Replication.of(settings).on is False  # no Sentinel: no WAIT


def test_sentinels_are_parsed_with_the_master_name_and_min_replicas() -> None:
    settings = BrokerSettings.from_env({"REDIS_SENTINELS": SENTINELS})
    assert settings.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26380))
    assert settings.url is None and settings.uses_sentinel
    assert settings.master_name == DEFAULT_MASTER_NAME == "mymaster"
    assert Replication.of(settings) == Replication(1, 1000)
    env = {
        "REDIS_SENTINELS": SENTINELS,
        "REDIS_MASTER_NAME": "llmq",
        "LLMQ_REDIS_MIN_REPLICAS": "2",
    }
    settings = BrokerSettings.from_env(env)
    assert (settings.master_name, settings.min_replicas) == ("llmq", 2)
    zero = BrokerSettings.from_env({**env, "LLMQ_REDIS_MIN_REPLICAS": "0"})
    assert Replication.of(zero).on is False


def test_a_url_and_sentinels_together_are_refused() -> None:
    both = {"REDIS_URL": "redis://h:1/0", "REDIS_SENTINELS": SENTINELS}
    with pytest.raises(BrokerConfigError, match="either REDIS_URL .* or REDIS_SENTINELS"):
        BrokerSettings.from_env(both)
    with pytest.raises(BrokerConfigError, match="not both"):  # the URL given as --redis-url
        BrokerSettings.from_env({"REDIS_SENTINELS": SENTINELS}, url="redis://h:1/0")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("host", "host:port entries"),
        ("host:port", "host:port entries"),
        ("h:1,,:2", "host:port entries"),
        ("http://h:1", "redis:// or rediss://"),
        (" , ", "names no Sentinel"),
    ],
)
def test_bad_sentinel_lists_say_what_was_expected(value: str, message: str) -> None:
    with pytest.raises(BrokerConfigError, match=message):
        BrokerSettings.from_env({"REDIS_SENTINELS": value})


@pytest.mark.parametrize("value", ["-1", "one", "1.5"])
def test_min_replicas_must_be_a_count(value: str) -> None:
    with pytest.raises(BrokerConfigError, match="LLMQ_REDIS_MIN_REPLICAS must be 0 or more"):
        BrokerSettings.from_env({"REDIS_SENTINELS": SENTINELS, "LLMQ_REDIS_MIN_REPLICAS": value})


def test_passwords_and_tls_reach_sentinels_and_servers() -> None:
    env = {
        "REDIS_SENTINELS": "rediss://sen:s3cret@10.0.0.1:26379,10.0.0.2:26380",
        "REDIS_PASSWORD": "m4ster",
        "REDIS_USERNAME": "llmq",
        "REDIS_DB": "3",
    }
    settings = BrokerSettings.from_env(env)
    assert settings.sentinel_kwargs == {"ssl": True, "password": "s3cret", "username": "sen"}
    assert settings.server_kwargs == {
        "db": 3,
        "password": "m4ster",
        "username": "llmq",
        "ssl": True,
    }
    client = settings.connect(socket_timeout=2.0)  # connects lazily: nothing is dialled here
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "mymaster"
    assert pool.connection_class is SentinelManagedSSLConnection  # the master speaks TLS
    kwargs = pool.connection_kwargs
    assert (kwargs["password"], kwargs["username"], kwargs["db"]) == ("m4ster", "llmq", 3)
    assert kwargs["socket_timeout"] == 2.0
    for sentinel in pool.sentinel_manager.sentinels:  # each Sentinel: TLS and its password
        sentinel_kwargs = sentinel.connection_pool.connection_kwargs
        assert sentinel_kwargs["password"] == "s3cret"
        assert sentinel.connection_pool.connection_class is redis.SSLConnection
    assert "s3cret" not in settings.describe() and "m4ster" not in settings.describe()


def test_a_url_keeps_its_password_and_tls() -> None:
    client = BrokerSettings(url="rediss://:pw@h:6380/2").connect()
    pool = client.connection_pool
    assert pool.connection_class is redis.SSLConnection
    assert (pool.connection_kwargs["password"], pool.connection_kwargs["db"]) == ("pw", 2)
    assert redact("rediss://:pw@h:6380/2") == "rediss://:***@h:6380/2"


def test_every_entry_point_refuses_both_settings(monkeypatch, capsys) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("REDIS_SENTINELS", "127.0.0.1:2")
    with pytest.raises(ConfigError, match="not both"):
        WorkerConfig.from_env()
    assert main(["api", "--port", str(free_port())]) == 2  # before gunicorn is started
    assert "not both" in capsys.readouterr().err
    with pytest.raises(ServeError, match="not both"):
        serve(ServeConfig(port=free_port()))
    monkeypatch.delenv("REDIS_URL")
    with pytest.raises(ConfigError, match="not both"):
        WorkerConfig.from_env(redis_url="redis://127.0.0.1:1/0")  # llmq worker --redis-url
    config = WorkerConfig.from_env()
    assert config.broker.sentinels == (("127.0.0.1", 2),)


def test_wait_refuses_a_write_no_replica_confirmed(redis_url: str) -> None:
    """A Redis without replicas: WAIT 1 times out with 0, so the write is not acknowledged."""
    conn = redis.Redis.from_url(redis_url)
    conn.set("llmq:test:guard", "1", ex=60)
    try:
        Replication(0).confirm(conn, "llmq:test:guard")  # off: never waits, never refuses
        started = time.monotonic()
        with pytest.raises(NotReplicated, match="0 of 1 replicas") as refused:
            Replication(1, timeout_ms=200).confirm(conn, "llmq:test:guard")
        assert 0.15 < time.monotonic() - started < 2
        assert isinstance(refused.value, redis.ConnectionError)  # handled as an outage
        assert conn.exists(keys.REPLICATION_MARK)  # the write WAIT waited for
        with pytest.raises(NotReplicated, match="not on the current master"):
            Replication(1, timeout_ms=200).confirm(conn, "llmq:test:missing")
    finally:
        conn.delete("llmq:test:guard", keys.REPLICATION_MARK)


def test_replication_state_names_the_server_and_its_replicas(redis_url: str) -> None:
    state = replication_state(redis.Redis.from_url(redis_url))
    address = redis_url.split("://")[1].split("/")[0]
    assert (state.master, state.role, state.sentinel) == (address, "master", False)
    assert state.replicas == int(redis.Redis.from_url(redis_url).info()["connected_slaves"])
    assert replication_state(fakeredis.FakeRedis()).role == "unknown"  # no INFO there


def test_llmq_serve_starts_no_redis_when_sentinels_name_the_master() -> None:
    broker = Broker(None, sentinel="sentinel mymaster via 127.0.0.1:2")
    assert broker.start() is None  # the children read REDIS_SENTINELS themselves
    assert (broker.kind, broker.server) == ("sentinel", None)
