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
from tests.api.conftest import _published_ready, hang_up_after, serving
from tests.api.sse import parse
from tests.events_cluster import flush, local_cluster
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
    hang_up_after(server, body)
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
