"""What the API does when replicas do not confirm a write (docs/faults.md F20), against a
real Redis without replicas: the app is told to wait for one (`WAIT 1 50`), which never
comes, so every acknowledgement fails the way it does when a Sentinel master's replicas lag.
The full failover, with real Sentinels, is tests/faults/test_f20_sentinel_failover.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from flask import Flask

from api.app import create_app
from tests.api.test_batches import create, jsonl, request_line, upload
from tests.api.test_job_flow import ASYNC, completion, job_records, status_of, wait_for
from workers import keys
from workers.wire.broker import Replication

pytestmark = pytest.mark.integration


@pytest.fixture
def unconfirmed(redis_url: str, real_redis) -> Iterator[Flask]:
    app = create_app({"TESTING": True, "REDIS_URL": redis_url, "REPLICATION": Replication(1, 50)})
    yield app
    app.extensions["redis"].close()


def _refused(response) -> None:
    assert response.status_code == 503, response.get_data(as_text=True)
    assert response.get_json()["error"]["code"] == "not_replicated"
    assert int(response.headers["Retry-After"]) > 0


def _queued(conn) -> int:
    return sum(conn.llen(k) for k in conn.scan_iter("rq:queue:llmq-*"))


@pytest.mark.parametrize("mode", ["async", "sync", "stream"])
def test_an_unconfirmed_job_without_a_key_is_refused_and_withdrawn(
    unconfirmed, worker, real_redis, mode: str
) -> None:
    worker.paused.set()  # registered, takes nothing: the job would wait on its queue
    headers = ASYNC if mode == "async" else {}
    body = completion(stream=True) if mode == "stream" else completion()
    _refused(unconfirmed.test_client().post("/v1/completions", json=body, headers=headers))
    [record] = job_records(real_redis)  # nobody could find it again: cancelled, off its queue
    assert status_of(real_redis, record.decode().split(":")[2]) == "cancelled"
    assert _queued(real_redis) == 0


def test_an_unconfirmed_job_with_a_key_stays_and_the_retry_gets_it(
    unconfirmed, live_client, worker, real_redis
) -> None:
    worker.paused.set()
    headers = {**ASYNC, "Idempotency-Key": "lagging"}
    client = unconfirmed.test_client()
    _refused(client.post("/v1/completions", json=completion(), headers=headers))
    _refused(client.post("/v1/completions", json=completion(), headers=headers))  # still lags
    [record] = job_records(real_redis)
    job_id = record.decode().split(":")[2]
    assert status_of(real_redis, job_id) == "queued" and _queued(real_redis) == 1
    # replicas confirm now (an app that waits for none stands for that): the same job
    retry = live_client.post("/v1/completions", json=completion(), headers=headers)
    assert retry.status_code == 202 and retry.get_json()["id"] == job_id
    worker.paused.clear()
    wait_for(lambda: status_of(real_redis, job_id) == "finished", 10)


def test_an_unconfirmed_upload_is_deleted_and_an_unconfirmed_batch_cancelled(
    unconfirmed, live_client, worker, real_redis
) -> None:
    content = jsonl(request_line("a", model="tiny", messages=[{"role": "user", "content": "x"}]))
    _refused(upload(unconfirmed.test_client(), content))
    assert list(real_redis.scan_iter(keys.file("*"))) == []
    file_id = upload(live_client, content).get_json()["id"]
    _refused(create(unconfirmed.test_client(), file_id))
    [batch] = live_client.get("/v1/batches").get_json()["data"]
    assert batch["status"] in ("cancelling", "cancelled")
