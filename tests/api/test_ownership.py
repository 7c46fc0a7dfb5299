"""With LLMQ_API_KEYS set, files, batches and async jobs belong to the key that created
them: another key gets 404 (as if they did not exist) and empty lists; Redis keeps only a
digest of the key. Unit tier on fakeredis, then the official `openai` client against a
real HTTP server on real Redis (db 13) with the fake worker and the real batch driver."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from typing import Any

import fakeredis
import httpx
import openai
import pytest
from flask import Flask
from flask.testing import FlaskClient

from api.app import create_app
from api.auth import owner_of
from tests.api.fake_worker import FakeWorker
from workers import keys
from workers.batches import BatchDriver
from workers.event_store import RedisEvents
from workers.wire.job import CHAT_COMPLETIONS, COMPLETIONS

KEY_A, KEY_B, ADMIN = "sk-a-CANARY-7f3a", "sk-b", "sk-admin"
A = {"Authorization": f"Bearer {KEY_A}"}
B = {"Authorization": f"Bearer {KEY_B}"}
ASYNC = {"Prefer": "respond-async"}
PROMPT = {"model": "tiny", "prompt": "hello", "max_tokens": 3}


def batch_input(count: int = 2) -> bytes:
    lines = []
    for i in range(count):
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"hi {i}"}]}
        line = {"custom_id": f"r{i}", "method": "POST", "url": CHAT_COMPLETIONS, "body": body}
        lines.append(json.dumps(line))
    return ("\n".join(lines) + "\n").encode()


def keyed_config(**config: Any) -> dict[str, Any]:
    return {"TESTING": True, "API_KEYS": (KEY_A, KEY_B), "ADMIN_KEY": ADMIN, **config}


# ---------------------------------------------------------------- unit tier (fakeredis)


@pytest.fixture
def keyed(fake_redis: fakeredis.FakeRedis, registered: FakeWorker) -> FlaskClient:
    return create_app(keyed_config(REDIS_CLIENT=fake_redis)).test_client()


def upload(client: FlaskClient, headers: dict[str, str], content: bytes | None = None) -> str:
    data = {"purpose": "batch", "file": (io.BytesIO(content or batch_input()), "in.jsonl")}
    response = client.post(
        "/v1/files", data=data, content_type="multipart/form-data", headers=headers
    )
    assert response.status_code == 200, response.json
    return response.json["id"]


def create_batch(client: FlaskClient, headers: dict[str, str], file_id: str) -> str:
    body = {"input_file_id": file_id, "endpoint": CHAT_COMPLETIONS, "completion_window": "24h"}
    response = client.post("/v1/batches", json=body, headers=headers)
    assert response.status_code == 200, response.json
    return response.json["id"]


def create_jobs(client: FlaskClient, headers: dict[str, str]) -> list[str]:
    """Two async jobs: `Prefer: respond-async` on a POST, and POST /v1/jobs."""
    first = client.post("/v1/completions", json=PROMPT, headers={**headers, **ASYNC})
    body = {"endpoint": COMPLETIONS, "body": PROMPT}
    second = client.post("/v1/jobs", json=body, headers=headers)
    assert first.status_code == second.status_code == 202
    return [first.json["id"], second.json["id"]]


def stored_bytes(conn: fakeredis.FakeRedis, key: bytes) -> bytes:
    """Everything a key holds, whatever its type, as one byte string."""
    kind = conn.type(key).decode()
    if kind == "string":
        return conn.get(key) or b""
    if kind == "hash":
        return b"".join(k + v for k, v in conn.hgetall(key).items())
    if kind == "list":
        return b"".join(conn.lrange(key, 0, -1))
    if kind == "set":
        return b"".join(conn.smembers(key))
    if kind == "zset":
        return b"".join(conn.zrange(key, 0, -1))
    if kind == "stream":
        return b"".join(k + v for _, f in conn.xrange(key) for k, v in f.items())
    raise AssertionError(f"unexpected type {kind} of {key!r}")


def assert_not_found(response: Any, code: str) -> None:
    """404 in OpenAI's error shape, exactly as for an id that never existed."""
    assert response.status_code == 404, response.get_data(as_text=True)
    error = response.json["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", code)


def test_another_key_gets_404_for_each_object_and_empty_lists(keyed) -> None:
    file_id = upload(keyed, A)
    batch_id = create_batch(keyed, A, file_id)
    job_ids = create_jobs(keyed, A)

    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content"):
        assert_not_found(keyed.get(path, headers=B), "file_not_found")
    assert_not_found(keyed.delete(f"/v1/files/{file_id}", headers=B), "file_not_found")
    body = {"input_file_id": file_id, "endpoint": CHAT_COMPLETIONS, "completion_window": "24h"}
    assert_not_found(keyed.post("/v1/batches", json=body, headers=B), "file_not_found")
    assert_not_found(keyed.get(f"/v1/batches/{batch_id}", headers=B), "batch_not_found")
    cancel = keyed.post(f"/v1/batches/{batch_id}/cancel", headers=B)
    assert_not_found(cancel, "batch_not_found")
    for job_id in job_ids:
        for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/events"):
            assert_not_found(keyed.get(path, headers=B), "job_not_found")
        assert_not_found(keyed.post(f"/v1/jobs/{job_id}/cancel", headers=B), "job_not_found")
    assert keyed.get("/v1/files", headers=B).json["data"] == []
    assert keyed.get("/v1/batches", headers=B).json["data"] == []

    # nothing B tried changed anything, and A still sees it all
    assert keyed.get(f"/v1/files/{file_id}/content", headers=A).data == batch_input()
    assert keyed.get(f"/v1/batches/{batch_id}", headers=A).json["status"] == "validating"
    assert [f["id"] for f in keyed.get("/v1/files", headers=A).json["data"]] == [file_id]
    assert [b["id"] for b in keyed.get("/v1/batches", headers=A).json["data"]] == [batch_id]
    for job_id in job_ids:
        assert keyed.get(f"/v1/jobs/{job_id}", headers=A).json["status"] == "queued"
    assert keyed.post(f"/v1/jobs/{job_ids[0]}/cancel", headers=A).status_code == 202
    assert keyed.post(f"/v1/batches/{batch_id}/cancel", headers=A).status_code == 200


def test_lists_mix_nothing_of_another_key(keyed) -> None:
    mine = [upload(keyed, A) for _ in range(3)]
    theirs = [upload(keyed, B) for _ in range(2)]
    listed = keyed.get("/v1/files?limit=2&order=asc", headers=A).json
    assert [f["id"] for f in listed["data"]] == mine[:2] and listed["has_more"]
    rest = keyed.get(f"/v1/files?limit=2&order=asc&after={mine[1]}", headers=A).json
    assert [f["id"] for f in rest["data"]] == mine[2:] and not rest["has_more"]
    assert [f["id"] for f in keyed.get("/v1/files", headers=B).json["data"]] == theirs[::-1]


def test_redis_keeps_a_digest_of_the_key_never_the_key(keyed, fake_redis) -> None:
    file_id = upload(keyed, A)
    batch_id = create_batch(keyed, A, file_id)
    job_ids = create_jobs(keyed, A)
    digest = owner_of(KEY_A)
    assert KEY_A not in digest and len(digest) == 32
    for key in (keys.file(file_id), keys.batch(batch_id), *map(keys.job, job_ids)):
        assert fake_redis.hget(key, "owner") == digest.encode()
    for key in fake_redis.scan_iter():
        assert b"CANARY" not in key and b"CANARY" not in stored_bytes(fake_redis, key)
    assert owner_of(KEY_B) != digest


def test_without_api_keys_nothing_is_scoped(client, fake_redis) -> None:
    file_id = upload(client, {"Authorization": "Bearer anything"})
    batch_id = create_batch(client, {}, file_id)
    job_ids = create_jobs(client, {})
    assert fake_redis.hget(keys.file(file_id), "owner") is None
    assert client.get(f"/v1/files/{file_id}", headers={"Authorization": "Bearer other"}).json
    assert client.get(f"/v1/batches/{batch_id}").status_code == 200
    assert all(client.get(f"/v1/jobs/{j}").status_code == 200 for j in job_ids)
    assert [b["id"] for b in client.get("/v1/batches").json["data"]] == [batch_id]


def test_objects_made_while_v1_was_open_stay_visible_to_every_key(fake_redis, registered):
    open_client = create_app({"TESTING": True, "REDIS_CLIENT": fake_redis}).test_client()
    file_id = upload(open_client, {})
    keyed = create_app(keyed_config(REDIS_CLIENT=fake_redis)).test_client()
    assert keyed.get(f"/v1/files/{file_id}", headers=B).status_code == 200
    assert [f["id"] for f in keyed.get("/v1/files", headers=A).json["data"]] == [file_id]


def test_admin_endpoints_still_see_every_keys_work(keyed) -> None:
    create_jobs(keyed, A)
    create_jobs(keyed, B)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    queues = keyed.get("/admin/queues", headers=admin).json["data"]
    queued = {q["name"]: q["queued"] for q in queues}
    assert queued[keys.queue_name("tiny", keys.INTERACTIVE)] == 4


def test_a_batchs_jobs_and_output_files_inherit_its_owner(keyed, fake_redis) -> None:
    batch_id = create_batch(keyed, A, upload(keyed, A))
    driver = BatchDriver(fake_redis, "test", RedisEvents(fake_redis))
    driver.tick()  # in progress, lines fed as jobs
    job_ids = [keys.batch_job_id(batch_id, line) for line in (1, 2)]
    assert_not_found(keyed.get(f"/v1/jobs/{job_ids[0]}", headers=B), "job_not_found")
    assert keyed.get(f"/v1/jobs/{job_ids[0]}", headers=A).status_code == 200
    worker = FakeWorker(fake_redis)
    for job_id in job_ids:
        fake_redis.lrem(f"rq:queue:{keys.queue_name('tiny', keys.BATCH)}", 1, job_id)
        worker.process(job_id)
    driver.tick()  # collected and finalized
    batch = keyed.get(f"/v1/batches/{batch_id}", headers=A).json
    assert batch["status"] == "completed" and batch["output_file_id"]
    output = f"/v1/files/{batch['output_file_id']}/content"
    assert_not_found(keyed.get(output, headers=B), "file_not_found")
    assert len(keyed.get(output, headers=A).data.splitlines()) == 2
    assert keyed.get("/v1/files", headers=B).json["data"] == []


# ---------------------------------------------------------------- integration tier


@pytest.fixture
def live_app(redis_url: str, real_redis) -> Iterator[Flask]:
    """The conftest's live app, with two API keys and an admin key."""
    app = create_app(keyed_config(REDIS_URL=redis_url, PING_SECONDS=0.5))
    yield app
    app.extensions["redis"].close()


@pytest.fixture
def clients(server: str) -> Iterator[tuple[openai.OpenAI, openai.OpenAI]]:
    made = [
        openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0, timeout=10)
        for key in (KEY_A, KEY_B)
    ]
    yield made[0], made[1]
    for client in made:
        client.close()


def drive_batch(real_redis, oai: openai.OpenAI, batch_id: str) -> Any:
    """The real batch driver, ticked here (the fake worker runs the lines) until it ends."""
    driver = BatchDriver(real_redis, "test-driver", RedisEvents(real_redis))
    deadline = time.monotonic() + 20
    while (batch := oai.batches.retrieve(batch_id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        driver.tick()
        time.sleep(0.05)
    return batch


@pytest.mark.integration
def test_openai_client_sees_only_its_own_files_batches_and_jobs(
    server, clients, worker, real_redis
) -> None:
    a, b = clients
    uploaded = a.files.create(file=("in.jsonl", batch_input()), purpose="batch")
    batch = a.batches.create(
        input_file_id=uploaded.id, endpoint=CHAT_COMPLETIONS, completion_window="24h"
    )
    batch = drive_batch(real_redis, a, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 2
    job = httpx.post(f"{server}/v1/completions", json=PROMPT, headers={**A, **ASYNC}, timeout=10)
    assert job.status_code == 202
    job_id = job.json()["id"]

    for call in (
        lambda: b.files.retrieve(uploaded.id),
        lambda: b.files.content(uploaded.id),
        lambda: b.files.content(batch.output_file_id),
        lambda: b.files.delete(uploaded.id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.batches.create(
            input_file_id=uploaded.id, endpoint=CHAT_COMPLETIONS, completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert b.files.list().data == [] and b.batches.list().data == []
    for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/events"):
        response = httpx.get(f"{server}{path}", headers=B, timeout=10)
        assert response.status_code == 404 and response.json()["error"]["code"] == "job_not_found"
    cancel = httpx.post(f"{server}/v1/jobs/{job_id}/cancel", headers=B, timeout=10)
    assert cancel.status_code == 404

    assert a.files.retrieve(uploaded.id).id == uploaded.id
    assert len(a.files.content(batch.output_file_id).text.splitlines()) == 2
    assert a.batches.retrieve(batch.id).status == "completed"
    assert {f.id for f in a.files.list().data} == {uploaded.id, batch.output_file_id}
    assert [x.id for x in a.batches.list().data] == [batch.id]
    polled = httpx.get(f"{server}/v1/jobs/{job_id}", headers=A, timeout=10)
    assert polled.status_code == 200 and polled.json()["id"] == job_id
