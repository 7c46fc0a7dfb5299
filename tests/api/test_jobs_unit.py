"""Job submission bookkeeping without a running worker (unit tier: fakeredis)."""

from __future__ import annotations

import json

from rq import Queue
from rq.serializers import JSONSerializer

from api.app import create_app
from workers import keys
from workers.wire.defaults import JOB_TTL_SECONDS
from workers.wire.events import decode_event
from workers.wire.job import JOB_FUNCTION, QUEUED

GOOD = {"model": "tiny", "prompt": "hello"}
ASYNC = {"Prefer": "respond-async"}


def test_async_submit_writes_record_and_rq_job(client, fake_redis) -> None:
    response = client.post("/v1/completions", json=GOOD, headers=ASYNC)
    assert response.status_code == 202
    job_id = response.get_json()["id"]
    assert response.get_json() == {"id": job_id, "object": "job", "status": QUEUED}
    assert response.headers["Location"] == f"/v1/jobs/{job_id}"
    assert keys.is_valid_job_id(job_id)
    record = fake_redis.hgetall(keys.job(job_id))
    assert json.loads(record[b"request"])["prompt"] == "hello"
    assert 0 < fake_redis.ttl(keys.job(job_id)) <= JOB_TTL_SECONDS
    queue = Queue(keys.queue_name("tiny"), connection=fake_redis, serializer=JSONSerializer)
    assert queue.job_ids == [job_id]
    job = queue.fetch_job(job_id)
    assert job.func_name == JOB_FUNCTION and job.args == [job_id]
    assert "hello" not in (job.description or "")  # no prompt text in RQ


def test_poll_a_queued_job(client) -> None:
    job_id = client.post(
        "/v1/chat/completions",
        headers=ASYNC,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
    ).get_json()["id"]
    view = client.get(f"/v1/jobs/{job_id}").get_json()
    assert view["status"] == "queued" and view["endpoint"] == "/v1/chat/completions"
    assert view["progress"] == {"completion_tokens": 0}
    assert "result" not in view


def test_post_jobs_endpoint(client) -> None:
    response = client.post(
        "/v1/jobs",
        json={"endpoint": "/v1/embeddings", "body": {"model": "tiny", "input": ["a", "b"]}},
    )
    assert response.status_code == 202
    assert response.headers["Location"].endswith(response.get_json()["id"])
    stream = client.post(
        "/v1/jobs", json={"endpoint": "/v1/completions", "body": {**GOOD, "stream": True}}
    )
    assert stream.status_code == 400


def test_cancel_queued_job_never_runs(client, fake_redis) -> None:
    """F5/F6: a queued job is taken off its queue and cancelled at once; again -> 409."""
    job_id = client.post("/v1/completions", json=GOOD, headers=ASYNC).get_json()["id"]
    response = client.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status_code == 202
    assert response.get_json()["status"] == "cancelled"
    assert fake_redis.llen(f"rq:queue:{keys.queue_name('tiny')}") == 0
    assert fake_redis.exists(keys.job_cancel(job_id))
    entries = fake_redis.xrange(keys.job_events(job_id))
    assert [decode_event(f)[0] for _, f in entries] == ["error"]
    assert decode_event(entries[0][1])[1]["error"]["code"] == "cancelled"
    again = client.post(f"/v1/jobs/{job_id}/cancel")
    assert again.status_code == 409
    events = client.get(f"/v1/jobs/{job_id}/events").get_data(as_text=True)
    assert "event: error" in events and '"cancelled"' in events


def test_queue_full_is_429(fake_redis, registered) -> None:
    app = create_app({"TESTING": True, "REDIS_CLIENT": fake_redis, "MAX_QUEUE": 2})
    client = app.test_client()
    statuses = [
        client.post("/v1/completions", json=GOOD, headers=ASYNC).status_code for _ in range(4)
    ]
    assert statuses == [202, 202, 429, 429]
    response = client.post("/v1/completions", json=GOOD, headers=ASYNC)
    assert response.headers["Retry-After"]
    assert response.get_json()["error"]["type"] == "rate_limit_error"
    assert fake_redis.llen(f"rq:queue:{keys.queue_name('tiny')}") == 2
    assert len(fake_redis.keys(keys.job("*"))) == 2  # no record without a queue entry


def test_idempotency_key_gives_one_job(client, fake_redis) -> None:
    headers = {**ASYNC, "Idempotency-Key": "order-42"}
    ids = {
        client.post("/v1/completions", json=GOOD, headers=headers).get_json()["id"]
        for _ in range(5)
    }
    assert len(ids) == 1
    assert fake_redis.llen(f"rq:queue:{keys.queue_name('tiny')}") == 1
    other = client.post(
        "/v1/completions", json=GOOD, headers={**ASYNC, "Idempotency-Key": "order-43"}
    )
    assert other.get_json()["id"] not in ids
    clash = client.post("/v1/embeddings", json={"model": "tiny", "input": "x"}, headers=headers)
    assert clash.status_code == 409
    bad = client.post(
        "/v1/completions", json=GOOD, headers={**ASYNC, "Idempotency-Key": "has space"}
    )
    assert bad.status_code == 400


def test_async_and_stream_conflict(client) -> None:
    response = client.post("/v1/completions", json={**GOOD, "stream": True}, headers=ASYNC)
    assert response.status_code == 400
    assert response.get_json()["error"]["param"] == "stream"
