"""The Files and Batch endpoints on fakeredis: OpenAI's shapes, file-level limits (413/400),
batch creation, listing and cancelling. The batch driver's own steps are in
tests/workers/test_batches.py."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from api.batches import files as files_module
from api.batches import store as batch_store
from api.batches.lines import ValidLine
from workers import keys
from workers.batches import BatchDriver
from workers.event_store import RedisEvents
from workers.wire.batches import BATCH_FAILED
from workers.wire.job import CHAT_COMPLETIONS
from workers.wire.webhooks import OutboxEntry

FILE_FIELDS = {"id", "object", "bytes", "created_at", "filename", "purpose", "status"}
BATCH_FIELDS = {
    "id",
    "object",
    "endpoint",
    "errors",
    "input_file_id",
    "completion_window",
    "status",
    "output_file_id",
    "error_file_id",
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
    "request_counts",
    "metadata",
}


EMPTY_FILE = [
    {"code": "empty_file", "message": "No requests.", "param": "input_file_id", "line": None}
]


def request_line(custom_id: str, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]} | body
    return {"custom_id": custom_id, "method": "POST", "url": CHAT_COMPLETIONS, "body": body}


def jsonl(*items: Any) -> bytes:
    return b"".join((i if isinstance(i, bytes) else json.dumps(i).encode()) + b"\n" for i in items)


def upload(client, content: bytes, purpose: str = "batch", **extra: Any):
    data = {"purpose": purpose, "file": (io.BytesIO(content), "in.jsonl"), **extra}
    return client.post("/v1/files", data=data, content_type="multipart/form-data")


def create(client, file_id: str, **overrides: Any):
    body = {"input_file_id": file_id, "endpoint": CHAT_COMPLETIONS, "completion_window": "24h"}
    return client.post("/v1/batches", json=body | overrides)


def test_upload_returns_openai_file_object_and_content_round_trips(client) -> None:
    content = jsonl(request_line("a"), request_line("b"))
    response = upload(client, content)
    assert response.status_code == 200
    obj = response.json
    assert FILE_FIELDS <= set(obj) and obj["object"] == "file" and obj["id"].startswith("file-")
    assert (obj["bytes"], obj["purpose"], obj["filename"]) == (len(content), "batch", "in.jsonl")
    assert obj["expires_at"] > obj["created_at"]
    assert client.get(f"/v1/files/{obj['id']}").json == obj
    assert client.get(f"/v1/files/{obj['id']}/content").data == content
    listed = client.get("/v1/files").json
    assert listed["object"] == "list" and [f["id"] for f in listed["data"]] == [obj["id"]]
    assert client.delete(f"/v1/files/{obj['id']}").json == {
        "id": obj["id"],
        "object": "file",
        "deleted": True,
    }
    assert client.get(f"/v1/files/{obj['id']}").status_code == 404


def test_file_level_violations_are_refused_at_upload(client, monkeypatch) -> None:
    assert upload(client, b"\xff\xfe garbage\n").status_code == 400
    assert upload(client, b"\n \n").json["error"]["code"] == "empty_file"
    assert upload(client, jsonl(request_line("a")), purpose="fine-tune").status_code == 400
    assert client.post("/v1/files", json={"purpose": "batch"}).status_code == 415
    no_file = client.post(
        "/v1/files", data={"purpose": "batch"}, content_type="multipart/form-data"
    )
    assert no_file.json["error"]["param"] == "file"
    monkeypatch.setattr(files_module, "MAX_BATCH_LINES", 2)
    too_many = upload(client, jsonl(*(request_line(str(i)) for i in range(3))))
    assert too_many.status_code == 400 and too_many.json["error"]["code"] == "too_many_lines"
    monkeypatch.setattr(files_module, "MAX_FILE_BYTES", 100)
    big = upload(client, jsonl(request_line("a"), request_line("b")))
    assert big.status_code == 413 and "100 bytes" in big.json["error"]["message"]
    huge = upload(client, b"x" * (files_module.MULTIPART_SLACK + 200))
    assert huge.status_code == 413 and "100 bytes" in huge.json["error"]["message"]


def test_expires_after_is_honoured_within_the_retention(client) -> None:
    fields = {"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}
    obj = upload(client, jsonl(request_line("a")), **fields).json
    assert obj["expires_at"] - obj["created_at"] == 3600
    fields["expires_after[seconds]"] = "99999999"
    assert upload(client, jsonl(request_line("a")), **fields).status_code == 400


def test_create_validates_lines_and_returns_a_validating_batch(client, fake_redis) -> None:
    file_id = upload(client, jsonl(request_line("a"), b"nope", request_line("b"))).json["id"]
    response = create(client, file_id, metadata={"run": "7"})
    assert response.status_code == 200
    batch = response.json
    assert BATCH_FIELDS <= set(batch) and batch["object"] == "batch"
    assert batch["id"].startswith("batch_") and batch["status"] == "validating"
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 1}
    assert batch["metadata"] == {"run": "7"} and batch["errors"] is None
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600
    assert client.get(f"/v1/batches/{batch['id']}").json == batch
    assert fake_redis.lrange(keys.batch_lines(batch["id"]), 0, -1) == [b"1", b"3"]
    error = json.loads(fake_redis.hget(keys.batch_errors(batch["id"]), 2))
    assert error["error"]["code"] == "invalid_json_line" and error["response"] is None
    for key in (keys.batch_requests(batch["id"]), keys.batch_errors(batch["id"])):
        assert 0 < fake_redis.ttl(key) <= 24 * 3600 + 3 * 24 * 3600


def test_create_refuses_bad_arguments(client) -> None:
    file_id = upload(client, jsonl(request_line("a"))).json["id"]
    assert create(client, "file-nope").status_code == 404
    assert create(client, "../etc").status_code == 404
    assert create(client, file_id, endpoint="/v1/nope").json["error"]["param"] == "endpoint"
    for window in ("48h", "1d", "", 24, "0h"):
        response = create(client, file_id, completion_window=window)
        assert response.json["error"]["param"] == "completion_window", window
    assert create(client, file_id, metadata={"k": 1}).status_code == 400
    assert create(client, file_id, extra=1).json["error"]["param"] == "extra"
    assert create(client, file_id, completion_window="30m").json["completion_window"] == "30m"


def test_list_batches_newest_first_with_after_cursor(client) -> None:
    file_id = upload(client, jsonl(request_line("a"))).json["id"]
    ids = [create(client, file_id).json["id"] for _ in range(3)]
    page = client.get("/v1/batches?limit=2").json
    assert [b["id"] for b in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    rest = client.get(f"/v1/batches?limit=2&after={page['last_id']}").json
    assert [b["id"] for b in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert client.get("/v1/batches?limit=0").status_code == 400


def test_cancel_moves_to_cancelling_and_a_finished_batch_cannot_be_cancelled(
    client, fake_redis
) -> None:
    file_id = upload(client, jsonl(request_line("a"))).json["id"]
    batch_id = create(client, file_id).json["id"]
    cancelled = client.post(f"/v1/batches/{batch_id}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json["status"] == "cancelling" and cancelled.json["cancelling_at"]
    assert client.post(f"/v1/batches/{batch_id}/cancel").json["status"] == "cancelling"
    BatchDriver(fake_redis, "test", RedisEvents(fake_redis)).tick()
    batch = client.get(f"/v1/batches/{batch_id}").json
    assert batch["status"] == "cancelled" and batch["request_counts"]["failed"] == 1
    again = client.post(f"/v1/batches/{batch_id}/cancel")
    assert again.status_code == 409
    assert client.post("/v1/batches/batch_nope/cancel").status_code == 404


@pytest.mark.parametrize("path", ["/v1/batches/x:y", "/v1/files/a%20b", "/v1/files/file-x/content"])
def test_unknown_or_malformed_ids_are_404(client, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404 and response.json["error"]["code"].endswith("not_found")


def test_files_and_batches_need_the_api_key(fake_redis, registered) -> None:
    from api.app import create_app

    app = create_app({"TESTING": True, "REDIS_CLIENT": fake_redis, "API_KEYS": ("sk-1",)})
    client = app.test_client()
    assert client.get("/v1/files").status_code == 401
    assert client.get("/v1/batches").status_code == 401
    headers = {"Authorization": "Bearer sk-1"}
    assert client.get("/v1/batches", headers=headers).status_code == 200


def test_a_batch_that_fails_at_creation_is_a_webhook_event_in_the_same_write(fake_redis) -> None:
    """api/batches/store.py: a batch refused whole (file-level errors) never runs, so its
    creation is its terminal write, and its `batch.failed` outbox entry goes with it; a batch
    that will run appends nothing yet (the driver appends its end, tests/workers)."""
    failed = batch_store.create_batch(
        fake_redis, CHAT_COMPLETIONS, "file-x", ("24h", 86400), None, [], [], EMPTY_FILE
    )
    runs = batch_store.create_batch(
        fake_redis,
        CHAT_COMPLETIONS,
        "file-y",
        ("24h", 86400),
        None,
        [ValidLine(1, "a", "tiny", {"model": "tiny", "messages": []})],
        [],
    )
    entries = [OutboxEntry.from_entry(i, f) for i, f in fake_redis.xrange(keys.WEBHOOK_OUTBOX)]
    assert [(e.kind, e.id, e.status) for e in entries] == [("batch", failed.id, BATCH_FAILED)]
    assert runs.status != BATCH_FAILED
