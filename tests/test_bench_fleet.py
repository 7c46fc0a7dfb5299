"""bench/fleet.py and bench/redis_cost.py run against real Redis and measure what they say:
the simulator's tokens reach its clients through a real API, every one, with its lag, on a
redis-server it starts (named in its output) or the one it is given; the writer's cost is
one script call a step."""

from __future__ import annotations

import os

import pytest
import redis

from bench import fleet, redis_cost
from workers import keys, scripts
from workers.redis_server import find_redis_server

pytestmark = pytest.mark.integration

REDIS_URL = os.environ.get("LLMQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")


@pytest.fixture
def conn():
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def test_the_writer_bench_sends_one_script_call_a_step_for_every_job(conn):
    scripts.WRITE_STEP.load(conn)  # a NOSCRIPT retry (another test flushed scripts) is not counted
    result = redis_cost.run(conn, jobs=5, steps=4)
    stats = result["stats"]
    assert result["tokens"] == 20
    assert int(stats["evalsha"]["calls"]) == 4  # every job's writes of a step in one call
    assert "eval" not in stats  # never the script's text
    assert int(stats["xadd"]["calls"]) == 20 + 5  # every token, then each job's end


def test_the_fleet_simulation_delivers_every_token_through_the_api(capsys):
    argv = ["--workers", "2", "--streams", "4", "--rate", "50", "--tokens", "6"]
    result = fleet.main([*argv, "--seconds", "1"])  # on a redis-server of its own
    out = capsys.readouterr().out
    assert "SIMULATION, no engine" in out
    assert f"broker: {find_redis_server().describe()} at redis://127.0.0.1:" in out
    streams = result["streams"]
    assert streams.failures == {} and result["worker_errors"] == {}
    assert streams.completed == streams.streams >= 4
    assert streams.tokens == result["written"] == 6 * streams.streams
    assert len(streams.lags) == streams.tokens and min(streams.lags) >= 0


def test_the_fleet_simulation_delivers_every_token_through_an_events_cluster(
    conn, capsys, tmp_path
):
    from tests.events_cluster import local_cluster

    with local_cluster(tmp_path) as ports:
        argv = ["--workers", "2", "--streams", "4", "--rate", "50", "--tokens", "6"]
        argv += ["--events-cluster", f"127.0.0.1:{ports[0]}"]
        result = fleet.main([*argv, "--seconds", "1", "--redis-url", REDIS_URL])
    out = capsys.readouterr().out
    assert "token events on a Redis Cluster of 3 primaries" in out
    assert "(--redis-url) at redis://127.0.0.1:" in out  # the broker it was given, named
    streams = result["streams"]
    assert streams.failures == {} and result["worker_errors"] == {}
    assert streams.completed == streams.streams >= 4
    assert streams.tokens == result["written"] == 6 * streams.streams
    assert len(result["per_server"]) == 4  # the queue Redis and 3 primaries
    streams_here = [k for k in conn.keys(f"{keys.JOB_KEY_PREFIX}*") if k.endswith(b":events")]
    assert streams_here == []  # the records are here, no job's stream
