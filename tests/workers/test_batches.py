"""The batch driver step by step on fakeredis: state transitions, bounded feeding, every
line answered exactly once (collecting again changes nothing), cancel and expiry."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest

from api.app import create_app
from tests.api.fake_worker import FakeWorker
from workers import keys
from workers.batches import BatchDriver, _tokens
from workers.wire.job import CHAT_COMPLETIONS, STARTED

QUEUE = "rq:queue:" + keys.queue_name("tiny", keys.BATCH)


class Harness:
    """The API (to create batches), a driver, and a fake worker run by hand."""

    def __init__(self) -> None:
        self.redis = fakeredis.FakeRedis()
        self.worker = FakeWorker(self.redis).register()
        self.client = create_app({"TESTING": True, "REDIS_CLIENT": self.redis}).test_client()
        self.driver = BatchDriver(self.redis, "driver-1", self.worker.events, queue_depth=4)

    def submit(self, *contents: str, bad: int = 0, **extra: Any) -> str:
        lines = [_line(f"r{i}", text) for i, text in enumerate(contents)]
        lines += [b"{broken" for _ in range(bad)]
        data = {"purpose": "batch", "file": (io.BytesIO(b"\n".join(lines)), "in.jsonl")}
        file_id = self.client.post("/v1/files", data=data).json["id"]
        body = {"input_file_id": file_id, "endpoint": CHAT_COMPLETIONS, "completion_window": "24h"}
        return self.client.post("/v1/batches", json=body | extra).json["id"]

    def batch(self, batch_id: str) -> dict[str, Any]:
        return self.client.get(f"/v1/batches/{batch_id}").json

    def run_queued(self, limit: int = 1000) -> list[str]:
        done = []
        while len(done) < limit and (job_id := self.redis.lpop(QUEUE)) is not None:
            self.worker.process(job_id.decode())
            done.append(job_id.decode())
        return done

    def file_lines(self, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        content = self.client.get(f"/v1/files/{file_id}/content").data
        return [json.loads(line) for line in content.splitlines()]


def _line(custom_id: str, text: str) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    item = {"custom_id": custom_id, "method": "POST", "url": CHAT_COMPLETIONS, "body": body}
    return json.dumps(item).encode()


@pytest.fixture
def h() -> Iterator[Harness]:
    yield Harness()


def test_feeding_wakes_an_idle_worker_of_the_batch_queue(h: Harness) -> None:
    wake_key = keys.queue_wake(keys.queue_name("tiny", keys.BATCH))
    h.submit("hi", "there")
    h.driver.tick()
    assert h.redis.llen(QUEUE) == 2
    assert h.redis.lrange(wake_key, 0, -1) == [b"1"]  # one per chunk fed, not per line
    assert h.redis.ttl(wake_key) > 0


def test_a_batch_runs_through_validating_in_progress_completed(h: Harness) -> None:
    batch_id = h.submit(*["hi"] * 10, bad=1)
    assert h.batch(batch_id)["status"] == "validating"
    h.driver.tick()
    batch = h.batch(batch_id)
    assert batch["status"] == "in_progress" and batch["in_progress_at"]
    assert h.redis.llen(QUEUE) == 4  # fed only up to the queue depth
    for _ in range(10):
        h.run_queued(limit=3)
        assert h.redis.llen(QUEUE) <= 4
        h.driver.tick()
    batch = h.batch(batch_id)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 11, "completed": 10, "failed": 1}
    assert batch["finalizing_at"] and batch["completed_at"]
    assert batch["usage"]["output_tokens"] == 20
    output = h.file_lines(batch["output_file_id"])
    assert [o["custom_id"] for o in output] == [f"r{i}" for i in range(10)]
    first = output[0]
    assert first["id"].startswith("batch_req_") and first["error"] is None
    assert first["response"]["status_code"] == 200
    assert first["response"]["body"]["choices"][0]["message"]["content"] == "t0 t1 "
    (error,) = h.file_lines(batch["error_file_id"])
    assert error["custom_id"] is None and error["error"]["code"] == "invalid_json_line"
    meta = h.client.get(f"/v1/files/{batch['output_file_id']}").json
    assert meta["purpose"] == "batch_output" and meta["filename"].endswith("_output.jsonl")
    # nothing that held prompt text is left behind but the files (with TTLs)
    assert not h.redis.keys(f"{keys.JOB_KEY_PREFIX}{batch_id}*")
    assert not h.redis.keys(keys.batch(batch_id) + ":*")
    assert not h.redis.sismember(keys.BATCHES_ACTIVE, batch_id)
    for file_id in (batch["output_file_id"], batch["error_file_id"]):
        assert h.redis.ttl(keys.file_content(file_id)) > 0
    assert h.redis.ttl(keys.batch(batch_id)) > 0


def test_collecting_twice_or_feeding_twice_never_answers_a_line_twice(h: Harness) -> None:
    batch_id = h.submit("a", "b")
    h.driver.tick()
    h.run_queued()
    h.redis.sadd(keys.batch_inflight(batch_id), 1)  # as if a driver died before its SREM
    h.worker.process(keys.batch_job_id(batch_id, 1))  # and the job record were still there
    other = BatchDriver(h.redis, "driver-2", h.worker.events, queue_depth=4)
    other.tick()
    h.driver.tick()
    batch = h.batch(batch_id)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert [o["custom_id"] for o in h.file_lines(batch["output_file_id"])] == ["r0", "r1"]


def test_only_the_lock_holder_drives(h: Harness) -> None:
    batch_id = h.submit("a")
    h.redis.set(keys.BATCHES_LOCK, "someone-else", px=10_000)
    h.driver.tick()
    assert h.batch(batch_id)["status"] == "validating"
    h.redis.delete(keys.BATCHES_LOCK)
    h.driver.tick()
    assert h.batch(batch_id)["status"] == "in_progress"
    assert h.redis.get(keys.BATCHES_LOCK) is None  # released after the tick


def test_failed_and_individually_cancelled_jobs_go_to_the_error_file(h: Harness) -> None:
    batch_id = h.submit("crash", "toolong", "fine", "stop me")
    h.driver.tick()
    h.client.post(f"/v1/jobs/{keys.batch_job_id(batch_id, 4)}/cancel")
    h.run_queued()
    h.driver.tick()
    batch = h.batch(batch_id)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 4, "completed": 1, "failed": 3}
    errors = {e["custom_id"]: e for e in h.file_lines(batch["error_file_id"])}
    assert errors["r0"]["response"]["status_code"] == 500
    assert errors["r0"]["response"]["body"]["error"]["type"] == "server_error"
    assert errors["r1"]["response"]["status_code"] == 400
    assert "context length" in errors["r1"]["error"]["message"]
    assert errors["r3"]["error"]["code"] == "cancelled"


def test_cancel_midway_keeps_partial_output_and_answers_the_rest(h: Harness) -> None:
    batch_id = h.submit(*[f"line {i}" for i in range(10)])
    h.driver.tick()
    h.run_queued(limit=2)  # lines 1-2 finish
    running = keys.batch_job_id(batch_id, 3)
    h.redis.lpop(QUEUE)
    h.redis.hset(keys.job(running), "status", STARTED)  # line 3 is on a worker
    h.client.post(f"/v1/batches/{batch_id}/cancel")
    h.driver.tick()
    assert h.batch(batch_id)["status"] == "cancelling"
    assert h.redis.exists(keys.job_cancel(running))  # the worker is told to stop
    assert h.redis.llen(QUEUE) == 0  # queued lines were taken off the queue
    h.worker.process(running)  # the worker sees the flag
    h.driver.tick()
    batch = h.batch(batch_id)
    assert batch["status"] == "cancelled" and batch["cancelled_at"]
    assert batch["request_counts"] == {"total": 10, "completed": 2, "failed": 8}
    assert [o["custom_id"] for o in h.file_lines(batch["output_file_id"])] == ["r0", "r1"]
    errors = h.file_lines(batch["error_file_id"])
    assert [e["custom_id"] for e in errors] == [f"r{i}" for i in range(2, 10)]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


def test_cancel_before_any_line_ran(h: Harness) -> None:
    batch_id = h.submit("a", "b")
    h.client.post(f"/v1/batches/{batch_id}/cancel")
    h.driver.tick()
    batch = h.batch(batch_id)
    assert batch["status"] == "cancelled" and batch["output_file_id"] is None
    assert batch["in_progress_at"] is None
    assert len(h.file_lines(batch["error_file_id"])) == 2


def test_a_batch_past_its_window_expires_with_unfinished_lines_as_errors(h: Harness) -> None:
    batch_id = h.submit(*[f"line {i}" for i in range(6)], completion_window="1s")
    h.driver.tick()
    h.run_queued(limit=3)
    time.sleep(1.05)
    h.driver.tick()
    h.driver.tick()
    batch = h.batch(batch_id)
    assert batch["status"] == "expired" and batch["expired_at"]
    assert batch["request_counts"] == {"total": 6, "completed": 3, "failed": 3}
    assert len(h.file_lines(batch["output_file_id"])) == 3
    errors = h.file_lines(batch["error_file_id"])
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert h.redis.llen(QUEUE) == 0


def test_all_lines_invalid_completes_with_only_an_error_file(h: Harness) -> None:
    batch_id = h.submit(bad=3)
    h.driver.tick()
    batch = h.batch(batch_id)
    assert batch["status"] == "completed" and batch["output_file_id"] is None
    assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 3}


def test_a_job_record_that_vanished_is_answered_as_lost(h: Harness) -> None:
    batch_id = h.submit("a", "b")
    h.driver.tick()
    lost = keys.batch_job_id(batch_id, 2)
    h.redis.delete(keys.job(lost))  # expired, say, while its worker was away
    h.redis.lrem(QUEUE, 1, lost)
    h.run_queued()
    h.driver.tick()
    batch = h.batch(batch_id)
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    (error,) = h.file_lines(batch["error_file_id"])
    assert (error["custom_id"], error["error"]["code"]) == ("r1", "job_lost")


def test_batch_jobs_are_batch_kind_records_with_deterministic_ids(h: Harness) -> None:
    batch_id = h.submit("a")
    h.driver.tick()
    raw = h.redis.hgetall(keys.job(keys.batch_job_id(batch_id, 1)))
    assert raw[b"kind"] == b"batch" and raw[b"batch_id"] == batch_id.encode()
    assert json.loads(raw[b"request"])["messages"][0]["content"] == "a"
    assert 0 < h.redis.ttl(keys.job(keys.batch_job_id(batch_id, 1)))
    assert h.redis.lrange(QUEUE, 0, -1) == [keys.batch_job_id(batch_id, 1).encode()]


def test_a_batch_line_waits_on_its_priority_level_and_counts_toward_the_feed_limit(
    h: Harness,
) -> None:
    """A line's `priority` orders it among batch work (its level of the batch queue; the
    claim still puts every interactive job first), and the driver's bound on queued batch
    jobs counts every level."""
    plain, urgent = _line("p", "plain"), json.loads(_line("u", "urgent"))
    urgent["body"]["priority"] = -4
    lines = [
        plain,
        json.dumps(urgent).encode(),
        *[plain.replace(b'"p"', b'"p%d"' % i) for i in range(5)],
    ]
    data = {"purpose": "batch", "file": (io.BytesIO(b"\n".join(lines)), "in.jsonl")}
    file_id = h.client.post("/v1/files", data=data).json["id"]
    body = {"input_file_id": file_id, "endpoint": CHAT_COMPLETIONS, "completion_window": "24h"}
    batch_id = h.client.post("/v1/batches", json=body).json["id"]
    h.driver.tick()
    level = "rq:queue:" + keys.level_queue_name(keys.queue_name("tiny", keys.BATCH), -4)
    assert h.redis.lrange(level, 0, -1) == [keys.batch_job_id(batch_id, 2).encode()]
    assert h.redis.llen(QUEUE) == 3  # queue_depth 4: the level's job counts too
    record = h.redis.hgetall(keys.job(keys.batch_job_id(batch_id, 2)))
    assert record[b"priority"] == b"-4" and record[b"kind"] == b"batch"
    assert h.redis.zrange(keys.queue_levels(keys.queue_name("tiny", keys.BATCH)), 0, -1) == [b"-4"]


def test_each_batch_end_appends_its_webhook_outbox_entry(h: Harness) -> None:
    from workers.wire.webhooks import OutboxEntry

    completed = h.submit("a")
    cancelled = h.submit("b", "c")
    h.client.post(f"/v1/batches/{cancelled}/cancel")
    expired = h.submit("d", completion_window="1s")
    h.driver.tick()
    h.run_queued(limit=1)
    time.sleep(1.05)
    for _ in range(3):
        h.driver.tick()
        h.run_queued(limit=3)
    ends = [OutboxEntry.from_entry(i, f) for i, f in h.redis.xrange(keys.WEBHOOK_OUTBOX)]
    assert {(e.kind, e.id, e.status) for e in ends} == {
        ("batch", completed, "completed"),
        ("batch", cancelled, "cancelled"),
        ("batch", expired, "expired"),
    }
    h.driver.tick()  # a terminal batch is only dropped from the active set: no second entry
    assert h.redis.xlen(keys.WEBHOOK_OUTBOX) == 3


def test_usage_totals_count_the_lines_reasoning_tokens(h: Harness, monkeypatch) -> None:
    """A thinking model's lines report completion_tokens_details.reasoning_tokens; the
    batch's usage adds them up in output_tokens_details, as a chat body has them."""
    result = h.worker._result

    def thinking(record, texts, count):
        body = result(record, texts, count)
        body["usage"]["completion_tokens_details"] = {"reasoning_tokens": count - 1}
        return body

    monkeypatch.setattr(h.worker, "_result", thinking)
    batch_id = h.submit("hi", "there", "again")
    for _ in range(3):
        h.driver.tick()
        h.run_queued()
    h.driver.tick()
    batch = h.batch(batch_id)
    assert batch["status"] == "completed"
    assert batch["usage"]["output_tokens"] == 6  # max_tokens 2 a line
    assert batch["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    # a Responses line's usage has them in output_tokens_details
    usage = {
        "input_tokens": 5,
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 2},
    }
    assert _tokens(usage) == (5, 0, 4, 2)
