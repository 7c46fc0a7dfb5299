"""The API and a real worker with the token events on a real local Redis Cluster
(`LLMQ_EVENTS_CLUSTER`): streams, sync answers, a job's `/events` and a cancel on a client's
hang-up all go through the cluster, the records stay on the queue Redis."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from flask import Flask

from api.app import create_app
from tests.api.conftest import _published_ready, serving
from tests.api.sse import parse
from tests.events_cluster import flush, local_cluster
from tests.tiny_models import write_tiny_llama
from tests.workers.conftest import WorkerThread, wait_for
from workers import keys
from workers.wire.broker import EventsSettings

pytestmark = pytest.mark.integration

MODEL = "tiny-llama-cluster"


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EventsSettings]:
    with local_cluster(tmp_path_factory.mktemp("cluster")) as ports:
        yield EventsSettings(((("127.0.0.1", ports[0])),))
        flush(ports)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / f"{MODEL}.gguf")


@pytest.fixture
def cluster_app(redis_url: str, real_redis, settings: EventsSettings) -> Iterator[Flask]:
    config = {"TESTING": True, "REDIS_URL": redis_url, "PING_SECONDS": 0.5, "EVENTS": settings}
    app = create_app(config)
    yield app
    app.extensions["redis"].close()


@pytest.fixture
def server(cluster_app: Flask) -> Iterator[str]:
    with serving(cluster_app) as url:
        yield url


@pytest.fixture
def worker(redis_url: str, real_redis, tiny_model: Path, settings: EventsSettings):
    runner = WorkerThread(redis_url, [str(tiny_model)], events=settings, step_delay=0.01)
    with runner as worker:
        wait_for(lambda: _published_ready(real_redis, worker.name, MODEL), 30, "model ready")
        yield worker


def _job_ids(conn: redis.Redis) -> list[str]:
    return [k.decode().split(":")[2] for k in conn.keys(keys.job("*")) if k.count(b":") == 2]


def test_streams_sync_answers_and_events_come_from_the_cluster(
    server, worker, real_redis, cluster_app
) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    sync = httpx.post(f"{server}/v1/completions", json=body, timeout=30).json()
    assert sync["usage"]["completion_tokens"] == 8
    with httpx.stream(
        "POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=30
    ) as response:
        lines = list(response.iter_lines())
    chunks = [line for line in lines if line.startswith("data: ")]
    assert chunks[-1] == "data: [DONE]"
    text = "".join(m.json()["choices"][0]["text"] for m in parse(lines) if m.data != "[DONE]")
    assert text == sync["choices"][0]["text"]
    job = httpx.post(f"{server}/v1/completions", json=body, headers={"Prefer": "respond-async"})
    url = f"{server}/v1/jobs/{job.json()['id']}/events"
    events = list(parse(httpx.get(url, timeout=30).text.split("\n")))
    assert [m.event for m in events if m.event] == ["token"] * 8 + ["done"]
    events_client = cluster_app.extensions["events"]
    for job_id in _job_ids(real_redis):
        assert not real_redis.exists(keys.job_events(job_id))  # on the cluster only
        assert events_client.xlen(keys.job_events(job_id)) == 9
    metrics = httpx.get(f"{server}/metrics").text
    [line] = [m for m in metrics.splitlines() if m.startswith("llmq_api_events_connections_open")]
    assert 1 <= float(line.split()[-1]) <= 3 * (keys.EVENT_BUCKETS + 8)


def test_a_client_that_hangs_up_cancels_its_job_on_the_cluster(server, worker, real_redis) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 240, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=30) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 6:
                break
    [job_id] = _job_ids(real_redis)
    wait_for(
        lambda: real_redis.hget(keys.job(job_id), "status") == b"cancelled",
        what="the worker to stop the job of the client that hung up",
    )


def test_many_streams_sharing_event_buckets_each_get_exactly_their_own_events(
    server, worker
) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    headers = {"Prefer": "respond-async"}
    ids = [
        httpx.post(f"{server}/v1/completions", json=body, headers=headers).json()["id"]
        for _ in range(keys.EVENT_BUCKETS + 8)  # more jobs than buckets: some share one
    ]
    assert len({keys.event_bucket(job_id) for job_id in ids}) < len(ids)
    with ThreadPoolExecutor(len(ids)) as pool:
        answers = list(
            pool.map(lambda i: httpx.get(f"{server}/v1/jobs/{i}/events", timeout=60).text, ids)
        )
    for job_id, text in zip(ids, answers, strict=True):
        events = [m for m in parse(text.split("\n")) if m.event]
        assert [m.event for m in events] == ["token"] * 4 + ["done"], job_id
        assert events[-1].json()["id"].endswith(job_id)


def test_the_stream_readers_send_each_read_to_its_node_without_asking_for_its_keys(
    real_redis, settings: EventsSettings
) -> None:
    """api/stream_hub.py on the cluster: every bucket's XREAD goes straight to the node of
    its slot; redis-py alone asks a server for XREAD's keys (COMMAND GETKEYS) twice a read."""
    from api.stream_hub import StreamHub
    from workers.wire.events import event_fields, token_event, write_ending
    from workers.wire.job import FINISHED

    cluster = settings.connect(real_redis)
    nodes = cluster.get_primaries()
    for node in nodes:
        cluster.config_resetstat(target_nodes=node)
    hub = StreamHub(real_redis, events=cluster)
    jobs = [f"routed-{i}" for i in range(3 * keys.EVENT_BUCKETS)]  # every bucket, every node
    followers = [hub.follow(job_id) for job_id in jobs]
    for job_id in jobs:
        fields = event_fields(token_event(0, 0, "t ", 0, None, None, 1))
        cluster.xadd(keys.job_events(job_id), fields)
        with cluster.pipeline(transaction=False) as pipe:
            write_ending(pipe, job_id, FINISHED, {"id": job_id, "choices": []})
            pipe.execute()
    for follower in followers:
        got = []
        while not got or not got[-1].terminal:
            got.extend(follower.take(10) or pytest.fail(f"{follower.job_id}: no events"))
        assert [event.kind for event in got] == ["token", "done"]
        hub.leave(follower)
    for node in nodes:
        stats = cluster.info("commandstats", target_nodes=node)
        assert stats.get("cmdstat_xread", {}).get("calls", 0) > 0, node.name
        assert "cmdstat_command|getkeys" not in stats, (node.name, stats)
    cluster.close()


def test_a_slot_missing_from_the_table_is_read_as_redis_py_routes_it(
    real_redis, settings: EventsSettings, monkeypatch
) -> None:
    """A failover under way: the reader's own lookup of the slot's node fails, and the call
    goes through redis-py's routing (its retries, a fresh slot table) instead of failing."""
    from redis.exceptions import SlotNotCoveredError

    from api.stream_hub import raw_xread
    from workers.wire.events import event_fields, token_event

    cluster = settings.connect(real_redis)
    key = keys.job_events("uncovered")
    entry = cluster.xadd(key, event_fields(token_event(0, 0, "t ", 0, None, None, 1)))

    def uncovered(*_args, **_kwargs):
        raise SlotNotCoveredError("slot not covered")

    monkeypatch.setattr(cluster.nodes_manager, "get_node_from_slot", uncovered)
    monkeypatch.setattr(cluster, "xread", lambda *a, **kw: ("routed", a, kw))
    assert raw_xread(cluster)({key: "0"}, 5, 10) == (
        "routed",
        ({key: "0"},),
        {"count": 5, "block": 10},
    )
    monkeypatch.undo()
    [[read_key, entries]] = raw_xread(cluster)({key: "0"}, 5, 10)
    assert read_key == key.encode() and entries[0][0] == entry
    cluster.close()
